"""The multiprocess clients: same outputs as in-process, no torch in the frontend, dead cores."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.errors import EngineDeadError, EngineStartupError, InsufficientKVCacheError
from lm_console.engine.frontend.core_client import InprocClient
from lm_console.engine.frontend.engine_process import startup_error
from lm_console.engine.frontend.mp_client import SyncMPClient
from lm_console.engine.protocol import EngineCoreStartupFailure
from llm_helpers import random_prompts, sigkill_during_generate, text_prompts

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _greedy_outputs(llm: LLM, prompts: list[list[int]], max_tokens: int = 24):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.num_cached_tokens,
             [sorted(d) for d in o.outputs[0].logprobs]) for o in outputs]


def _compare_modes(model: str | None, prompts_of, passes: int = 2, max_tokens: int = 24, **engine_args) -> None:
    inproc = LLM(model, multiprocess=False, **engine_args)
    assert isinstance(inproc.engine_core, InprocClient)
    prompts = prompts_of(inproc)
    # A second pass runs on prefix-cache hits.
    expected = [_greedy_outputs(inproc, prompts, max_tokens) for _ in range(passes)]
    inproc.shutdown()
    mp = LLM(model, **engine_args)
    assert isinstance(mp.engine_core, SyncMPClient)
    assert [_greedy_outputs(mp, prompts, max_tokens) for _ in range(passes)] == expected
    # The frontend's config is the core's, from the ready handshake (num_blocks decided).
    assert mp.config == inproc.config and mp.config.cache_config.num_blocks > 0
    mp.shutdown()


def test_multiprocess_equals_inprocess_on_a_tiny_model(tiny_llama_dir) -> None:
    _compare_modes(str(tiny_llama_dir), lambda llm: random_prompts(llm.config.model_config.vocab_size, 8, 5, 80),
                   dtype="float32", max_model_len=256, num_gpu_blocks_override=256)


@pytest.mark.slow
def test_multiprocess_equals_inprocess_on_the_embedded_model(embedded_model_dir) -> None:
    _compare_modes(None, lambda llm: text_prompts(llm.get_tokenizer(), 3, 5, 100), passes=1,
                   max_tokens=16, dtype="float32", max_model_len=512, num_gpu_blocks_override=256)


def test_frontend_process_imports_no_torch(tiny_llama_dir) -> None:
    script = (
        "import asyncio, sys\n"
        "from lm_console import engine\n"
        "from lm_console.engine import SamplingParams\n"
        "async def main():\n"
        f"    async with engine.AsyncLLM({str(tiny_llama_dir)!r}, dtype='float32', max_model_len=128,\n"
        "                               num_gpu_blocks_override=64) as llm:\n"
        "        async for out in llm.generate('hi', SamplingParams(max_tokens=3)):\n"
        "            pass\n"
        "    print('torch' in sys.modules, 'transformers.modeling_utils' in sys.modules, out.finished)\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=REPO, env={**os.environ, "LMC_ENGINE_START_METHOD": "spawn"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "True"], result.stdout


def test_killing_the_core_fails_a_blocked_generate_within_2s(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=256)
    error, waited = sigkill_during_generate(llm, lambda: llm.get_stats().num_running_reqs > 0,
                                            llm.engine_core.proc.pid, num_requests=8, max_tokens=240, join_s=5)
    assert isinstance(error, EngineDeadError) and waited < 2.0
    assert llm.engine_core.errored
    with pytest.raises(EngineDeadError):
        llm.generate("again", use_tqdm=False)
    with pytest.raises(EngineDeadError):
        llm.get_stats()
    llm.shutdown()
    llm.shutdown()  # idempotent


def test_tcp_transport_and_private_ipc_dir(tiny_llama_dir) -> None:
    tcp = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
              zmq_transport="tcp")
    assert tcp.engine_core.resources.addresses.input_address.startswith("tcp://127.0.0.1:")
    out = tcp.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    tcp.shutdown()
    ipc = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
    ipc_dir = ipc.engine_core.resources.addresses.ipc_dir
    assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
    pid = ipc.engine_core.proc.pid
    ipc.shutdown()
    assert not os.path.exists(ipc_dir) and not ipc.engine_core.proc.is_alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_startup_errors_keep_their_type() -> None:
    known = startup_error(EngineCoreStartupFailure("InsufficientKVCacheError", "lm_console.engine.errors", "too small", "tb"))
    assert isinstance(known, InsufficientKVCacheError) and str(known) == "too small"
    builtin = startup_error(EngineCoreStartupFailure("FileNotFoundError", "builtins", "gone"))
    assert isinstance(builtin, FileNotFoundError)
    other = startup_error(EngineCoreStartupFailure("OutOfMemoryError", "torch.cuda", "oom"))
    assert isinstance(other, EngineStartupError) and "OutOfMemoryError: oom" in str(other)
