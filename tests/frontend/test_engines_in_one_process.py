"""Issue 38's acceptance: one process (a notebook, a test suite) builds engines one after another:
a TP engine over worker processes, a TP engine over Ray worker actors, a DP engine; each answers
and is shut down before the next starts.

Three ranks of 1 CPU each do not fit the session's 2-CPU Ray instance: the Ray engine's workers ask
for half a CPU each (ray_per_worker_cpus), as a Ray user on a small machine would.
"""

from __future__ import annotations

import os

import pytest

# Set before Ray loads: a single-machine instance on 127.0.0.1 (Ray otherwise uses the machine's address).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="the [ray] extra installs Ray")

from lm_console.engine import LLM, SamplingParams  # noqa: E402
from llm_helpers import assert_no_leaked_blocks, random_prompts  # noqa: E402

pytestmark = pytest.mark.slow

ARGS = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=64)


def test_mp_tp_then_ray_tp_then_dp_in_one_process(local_ray, tiny_llama_tp3_dir) -> None:
    prompts = random_prompts(49152, 3, 5, 40, seed=38)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    answers: dict[str, list[list[int]]] = {}
    for name, engine_args in (
        ("mp_tp3", dict(tensor_parallel_size=3)),
        ("ray_tp3", dict(tensor_parallel_size=3, distributed_executor_backend="ray", ray_per_worker_cpus=0.5)),
        ("dp2", dict(data_parallel_size=2)),
    ):
        llm = LLM(str(tiny_llama_tp3_dir), **engine_args, **ARGS)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            answers[name] = [o.outputs[0].token_ids for o in outputs]
            assert_no_leaked_blocks(llm)
        finally:
            llm.shutdown()
        assert all(len(tokens) == 8 for tokens in answers[name]), (name, answers[name])
    assert answers["ray_tp3"] == answers["mp_tp3"]  # the same three ranks' arithmetic, over Ray
    assert not ray.util.list_named_actors()  # the Ray engine's worker actors went with it


def _engine_in_this_process(model: str, answers) -> None:  # noqa: ANN001 - a multiprocessing queue
    """Build an LLM here (a daemonic process in the test), generate, shut down; put what came out."""
    try:
        llm = LLM(model, distributed_executor_backend="fake", device="cpu", max_model_len=128)
        try:
            outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True),
                                   use_tqdm=False)
        finally:
            llm.shutdown()
        answers.put(outputs[0].outputs[0].token_ids)
    except BaseException as error:  # noqa: BLE001 - the test shows it
        answers.put(f"{type(error).__name__}: {error}")


def test_an_engine_starts_in_a_daemonic_process(tiny_llama_dir) -> None:
    """A multiprocessing.Pool or Celery worker is daemonic; multiprocessing refuses it children
    ("daemonic processes are not allowed to have children"), yet the engine core it starts needs
    no reaping from it (the core exits with its parent through its death pipe)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    host = context.Process(target=_engine_in_this_process, args=(str(tiny_llama_dir), answers), daemon=True)
    host.start()
    try:
        answer = answers.get(timeout=300)
    finally:
        host.join(60)
    assert isinstance(answer, list) and len(answer) == 3, answer
    assert host.exitcode == 0
