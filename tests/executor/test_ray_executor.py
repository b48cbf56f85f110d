"""RayDistributedExecutor over a local Ray instance: TP=2 over two worker actors gives the greedy
tokens of TP=1 in one process, and a worker actor's death is an EngineDeadError in every caller."""

from __future__ import annotations

import os

import pytest

# Set before Ray loads: a single-machine instance on 127.0.0.1 (Ray otherwise uses the machine's address).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="the [ray] extra installs Ray")

from engine import LLM, SamplingParams  # noqa: E402
from engine.errors import EngineDeadError  # noqa: E402
from llm_helpers import random_prompts, sigkill_during_generate  # noqa: E402

ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, device="cpu")


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def test_tp2_over_ray_equals_tp1_and_a_dead_actor_fails_every_caller(local_ray, tiny_llama_dir) -> None:
    single = LLM(str(tiny_llama_dir), multiprocess=False, **ARGS)
    prompts = random_prompts(single.config.model_config.vocab_size, 4, 5, 60, seed=7)
    expected = _greedy(single, prompts)
    single.shutdown()
    llm = LLM(str(tiny_llama_dir), distributed_executor_backend="ray", tensor_parallel_size=2, **ARGS)
    try:
        assert _greedy(llm, prompts) == expected
        assert llm.get_block_pool_state().all_free
        names = sorted(ray.util.list_named_actors())
        core_pid = llm.engine_core.proc.pid
        assert names == [f"lmc-worker-{core_pid}-dp0-tp0", f"lmc-worker-{core_pid}-dp0-tp1"]
        actor_pid = ray.get(ray.get_actor(names[1]).getpid.remote())
        error, waited = sigkill_during_generate(llm, lambda: llm.get_stats().num_running_reqs > 0, actor_pid)
        assert isinstance(error, EngineDeadError)
        assert "Ray worker actor" in str(error) and waited < 2.0
        with pytest.raises(EngineDeadError):
            llm.get_stats()
    finally:
        llm.shutdown()
    assert not ray.util.list_named_actors()  # the core's actors went with it


def test_ray_error_messages_lose_their_colour_codes() -> None:
    from engine.executor.ray_executor import _first_line

    error = RuntimeError("\x1b[36mray::RayWorkerWrapper.execute_method()\x1b[39m (pid=7, ip=127.0.0.1)\n  File ...")
    assert _first_line(error) == "ray::RayWorkerWrapper.execute_method() (pid=7, ip=127.0.0.1)"
    assert _first_line(RuntimeError("")) == "RuntimeError('')"
