"""`lmc generate`'s fast start: the engine core in the CLI's process gives the text the separate
core process gave, and LMC_STARTUP_TRACE marks every start-up phase once, in order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lm_console.engine.startup_trace import ENV_VAR, parse_marks
from lm_console.cli import app

pytestmark = pytest.mark.slow

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Hello there, how are"
# The phases `lmc generate` marks with the core in its process, in the order they end.
PHASES = ["cli", "engine_import", "engine_args", "config", "device", "weights", "kv_cache", "engine_core",
          "tokenizer", "first_token", "done"]


def _core_process_text(model: str | None, max_tokens: int, **engine_args: object) -> str:
    """What `lmc generate` printed before it ran the core in its own process: LLM's default client."""
    from lm_console.engine import LLM, SamplingParams

    llm = LLM(model=model, multiprocess=True, **engine_args)
    try:
        out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    finally:
        llm.shutdown()
    return out[0].outputs[0].text


def test_generate_in_process_matches_the_core_process(tiny_llama_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy bf16 (the dense default on the CPU): the same text from both paths, and the marks."""
    from lm_console.engine import startup_trace

    monkeypatch.setenv(ENV_VAR, "1")
    monkeypatch.setattr(startup_trace, "_seen", set())  # marks print once per process
    result = runner.invoke(app, ["generate", PROMPT, "--model", str(tiny_llama_dir), "--max-tokens", "6",
                                 "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert result.stdout == _core_process_text(str(tiny_llama_dir), 6, dtype="bfloat16") + "\n"
    marks = parse_marks(result.stderr)
    assert [phase for phase, *_ in marks] == PHASES
    times = [t for _, t, _, _ in marks]
    assert times == sorted(times) and len({pid for *_, pid in marks}) == 1  # one process


def test_generate_process_prints_everything_and_exits_0(tiny_llama_dir: Path) -> None:
    """As a user runs it (a process of its own, stdout a pipe): the output is whole although the
    process skips the interpreter's teardown after it, and the exit status is 0."""
    args = ["generate", PROMPT, "--model", str(tiny_llama_dir), "--max-tokens", "6", "--dtype", "bfloat16",
            "--n", "2", "--temperature", "0"]
    in_test = runner.invoke(app, args)
    assert in_test.exit_code == 0, in_test.output
    env = dict(os.environ, PYTHONPATH=str(ROOT), LMC_STARTUP_TRACE="1")
    done = subprocess.run([sys.executable, "-m", "lm_console.cli", *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == in_test.stdout and done.stdout.count("--- completion") == 2
    assert [phase for phase, *_ in parse_marks(done.stderr)] == PHASES


@pytest.mark.slow
def test_embedded_model_gguf_in_process_matches_the_core_process() -> None:
    """The embedded SmolLM2 on its own packed GGUF weights: the same 16 tokens either way."""
    result = runner.invoke(app, ["generate", PROMPT, "--max-tokens", "16", "--quantization", "gguf"])
    if result.exit_code == 2 and "not installed" in result.output:
        pytest.skip("the embedded model's package is not installed")
    assert result.exit_code == 0, result.output
    assert result.stdout == _core_process_text(None, 16, quantization="gguf") + "\n"
