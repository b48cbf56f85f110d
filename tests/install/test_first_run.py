"""The first run of a new user, as `make run` does it: nothing cached, the real import order.

A filled model cache once hid a broken first run from every test (the GGUF -> HF conversion,
which only an empty cache reaches, imported transformers' hub-kernels integration, which found our
own top-level `kernels` package). This test starts `lmc` with the arguments of the Makefile's run
target in a new process, with HOME and XDG_CACHE_HOME pointed at new, empty directories, and
checks that the console serves: the embedded model converted, the built-in load answered, a chat
question answered, the engine log where the cache settings say.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("first_run_driver.py")


def make_run_args() -> list[str]:
    """The arguments `make run` passes to lmc (the Makefile's run recipe is the one source)."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("run:")))
    recipe = lines[start + 1].strip()
    words = shlex.split(recipe)
    assert words[0].endswith("/bin/lmc"), f"the run recipe is not an lmc call: {recipe!r}"
    return words[1:]


def clean_env(home: Path, xdg: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LMC_", "HF_", "TRANSFORMERS_", "TRITON_", "PYTEST_")) and k != "PYTHONPATH"}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(xdg), CUDA_VISIBLE_DEVICES="")
    return env


def test_make_run_args_are_the_console_over_the_embedded_model() -> None:
    args = make_run_args()
    assert args[0] == "tui" and "--load" in args and "--model" not in args, args


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_first_run_with_an_empty_cache_serves_and_answers(tmp_path: Path) -> None:
    home, xdg = tmp_path / "home", tmp_path / "xdg"
    home.mkdir()
    xdg.mkdir()
    done = subprocess.run([sys.executable, str(DRIVER), *make_run_args()], cwd=tmp_path, env=clean_env(home, xdg),
                          capture_output=True, text=True, timeout=1100, stdin=subprocess.DEVNULL)
    lines = [line for line in done.stdout.splitlines() if line.startswith("FIRST-RUN ")]
    assert done.returncode == 0 and lines, (
        f"exit {done.returncode}\nstdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-8000:]}")
    seen = json.loads(lines[-1].removeprefix("FIRST-RUN "))
    assert seen["engine_state"] == "serving" and seen["load_finished"] >= 2, seen
    assert seen["reply"].strip(), seen
    # Everything the first run wrote is under the cache root its settings name: the converted
    # model, the compiled kernels and the console's engine log.
    cache = xdg / "lm-console"
    assert any((cache / "models").iterdir()), "no converted model in the new cache"
    assert Path(seen["log_path"]).parent == cache / "logs" and (cache / "logs").is_dir(), seen
    assert not (home / ".cache" / "lm-console").exists(), "something ignored XDG_CACHE_HOME"
    # A top-level `kernels` is Hugging Face's distribution or nothing, never a folder of ours.
    # (The venv may live inside the clone, as `make` puts it: what counts is that the module comes
    # from an installed distribution's site-packages, not from a folder of the repository's tree.)
    kernels = seen["top_level_kernels"]
    assert kernels is None or ("site-packages" in Path(kernels).parts
                               and Path(kernels).parent.parent != ROOT), seen
