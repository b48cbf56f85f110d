"""RayDistributedExecutor over a local Ray instance: TP=2 over two worker actors gives the greedy
tokens of TP=1 in one process, and a worker actor's death is an EngineDeadError in every caller."""

from __future__ import annotations

import os
import threading

import pytest

# Set before Ray loads: a single-machine instance on 127.0.0.1 (Ray otherwise uses the machine's address).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="the [ray] extra installs Ray")

from lm_console.engine import LLM, SamplingParams  # noqa: E402
from lm_console.engine.errors import EngineDeadError  # noqa: E402
from broken_variants import rank1_attention_zeroed  # noqa: E402
from llm_helpers import assert_all_equal, random_prompts, sigkill_during_generate  # noqa: E402

pytestmark = pytest.mark.slow

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
        assert_all_equal(_greedy(llm, prompts), expected, "TP=2 over Ray vs TP=1")
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


def test_negative_control_rank1_attention_zeroed_fails_the_ray_tp_check(tiny_llama_dir) -> None:
    """The Ray TP check on an engine whose rank-1 heads lost their attention (emulated in-process,
    tests/broken_variants.py) must fail."""
    single = LLM(str(tiny_llama_dir), multiprocess=False, **ARGS)
    prompts = random_prompts(single.config.model_config.vocab_size, 4, 5, 60, seed=7)
    expected = _greedy(single, prompts)
    single.shutdown()
    with rank1_attention_zeroed():
        single = LLM(str(tiny_llama_dir), multiprocess=False, **ARGS)
        broken = _greedy(single, prompts)
        single.shutdown()
    with pytest.raises(AssertionError, match="exactly equal"):
        assert_all_equal(broken, expected, "TP=2 over Ray vs TP=1")


def test_ray_error_messages_lose_their_colour_codes() -> None:
    from lm_console.engine.executor.ray_executor import _first_line

    error = RuntimeError("\x1b[36mray::RayWorkerWrapper.execute_method()\x1b[39m (pid=7, ip=127.0.0.1)\n  File ...")
    assert _first_line(error) == "ray::RayWorkerWrapper.execute_method() (pid=7, ip=127.0.0.1)"
    assert _first_line(RuntimeError("")) == "RuntimeError('')"


def _waiters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "RayStepWaiter"]


def test_non_blocking_calls_share_one_waiter_thread_in_order(local_ray, tiny_llama_dir) -> None:
    from lm_console.engine.config import EngineArgs
    from lm_console.engine.executor.abstract import Executor
    from lm_console.engine.model_runner_output import ModelRunnerOutput
    from lm_console.engine.scheduler_output import CachedRequestData, SchedulerOutput

    # Local functions: Ray pickles them by value (the actor cannot import this test module).
    def _index(worker: object, i: int) -> int:
        return i

    def _refuse(worker: object) -> None:
        raise RuntimeError("this step refuses")

    def _block_forever(worker: object) -> None:
        import threading

        threading.Event().wait()

    config = EngineArgs(model=str(tiny_llama_dir), distributed_executor_backend="ray", **ARGS).create_engine_config()
    executor = Executor.get_class(config)(config)
    try:
        assert not _waiters()  # started on the first non-blocking call, not before
        executor.initialize_kv_cache(32)
        empty = SchedulerOutput([], CachedRequestData(), {}, 0, set(), set())
        resolved: list[tuple[int, str]] = []  # (submission index, thread that resolved it)
        futures = []
        for step in range(8):
            futures.append(executor.execute_model(empty, non_block=True))
            futures.append(executor.sample_tokens(non_block=True))
            if step == 3:  # a failing call in between: its future gets the error, the rest go on
                refused = executor._future(executor._submit(_refuse), lambda results: results[0])
                futures.append(refused)
            futures.append(executor._future(executor._submit(_index, (step,)), lambda results: results[0]))
        for i, future in enumerate(futures):
            future.add_done_callback(lambda f, i=i: resolved.append((i, threading.current_thread().name)))
        assert len(_waiters()) == 1
        assert futures[-1].result(timeout=120) == 7
        assert [i for i, _ in resolved] == list(range(len(futures)))  # in submission order
        assert {name for _, name in resolved} <= {"RayStepWaiter", threading.current_thread().name}
        outputs = [f.result() for f in futures if f is not refused]
        assert [o for o in outputs if isinstance(o, int)] == list(range(8))
        assert sum(isinstance(o, ModelRunnerOutput) for o in outputs) == 8
        with pytest.raises(RuntimeError, match="this step refuses"):
            refused.result()
        assert len(_waiters()) == 1 and _waiters()[0].daemon
        # A call still pending at shutdown gets an answer naming the shutdown, and so does one after.
        pending = executor._future(executor._submit(_block_forever), lambda results: None)
    finally:
        executor.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        pending.result(timeout=60)
    with pytest.raises(EngineDeadError, match="shut down"):
        executor.sample_tokens(non_block=True).result(timeout=0)
    assert not _waiters()  # the waiter ended with the executor
    assert not ray.util.list_named_actors()


def test_bundles_that_fit_count_each_node_on_its_own() -> None:
    from lm_console.engine.executor.ray_utils import bundles_that_fit, worker_bundle

    assert worker_bundle("cpu") == {"CPU": 1.0} and worker_bundle("cpu", 0.5) == {"CPU": 0.5}
    assert worker_bundle("cuda") == {"GPU": 1.0} and worker_bundle("cuda", 2) == {"GPU": 1.0, "CPU": 2.0}
    assert bundles_that_fit({"CPU": 1.0}, [{"CPU": 2.0}]) == 2
    assert bundles_that_fit({"CPU": 0.6666}, [{"CPU": 2.0}]) == 3  # Ray's 1/10000 units, no float slack
    assert bundles_that_fit({"CPU": 2.0}, [{"CPU": 3.0}, {"CPU": 3.0}]) == 2  # 4 CPUs in all, but per node
    assert bundles_that_fit({"GPU": 1.0, "CPU": 1.0}, [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 1.0}]) == 2
    assert bundles_that_fit({"GPU": 1.0}, []) == 0


def test_the_refusal_suggests_a_size_the_heads_divide_by() -> None:
    from lm_console.engine.executor.ray_executor import _worker_remedy

    two_cpus = [{"CPU": 2.0}]
    assert _worker_remedy(3, "cpu", (9, 3), 2, two_cpus) == (
        "use tensor_parallel_size=1, or let the 3 workers share the CPUs with the engine argument "
        "ray_per_worker_cpus=0.66 (CPUs each worker reserves; default 1)")
    assert _worker_remedy(4, "cuda", (8, 4), 2, [{"GPU": 2.0}]).startswith(
        "use tensor_parallel_size=2 (or fewer that the model's heads divide by) (one GPU per rank)")
    assert _worker_remedy(2, "cuda", (8, 4), 0, []) == "use a cluster with room for one worker (one GPU per rank)"


def test_ray_per_worker_cpus_is_checked() -> None:
    from lm_console.engine.config import EngineArgs
    from lm_console.engine.errors import InvalidEngineArgsError

    for bad in (0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(InvalidEngineArgsError, match="ray_per_worker_cpus=.* must be a finite number"):
            EngineArgs(distributed_executor_backend="ray", ray_per_worker_cpus=bad)._verify()
    with pytest.raises(InvalidEngineArgsError, match="needs distributed_executor_backend='ray'"):
        EngineArgs(tensor_parallel_size=2, ray_per_worker_cpus=0.5)._verify()
    args = EngineArgs(distributed_executor_backend="ray", ray_per_worker_cpus=1)
    args._verify()
    assert args.create_parallel_config().ray_per_worker_cpus == 1.0


def test_a_cluster_that_can_never_hold_the_workers_is_refused_at_once(local_ray, tiny_llama_tp3_dir) -> None:
    """Issue 38: 3 workers of 1 CPU on a 2-CPU cluster waited 60 s for resources that can never
    come. Now the refusal is immediate and says what to change."""
    import time

    from lm_console.engine.config import EngineArgs
    from lm_console.engine.errors import EngineStartupError
    from lm_console.engine.executor.abstract import Executor

    assert local_ray.cluster_resources()["CPU"] == 2.0
    config = EngineArgs(model=str(tiny_llama_tp3_dir), distributed_executor_backend="ray", tensor_parallel_size=3,
                        **ARGS).create_engine_config()
    started = time.monotonic()
    with pytest.raises(EngineStartupError) as refused:
        Executor.get_class(config)(config)
    assert time.monotonic() - started < 5.0
    message = str(refused.value)
    assert "can never place 3 workers with {'CPU': 1.0} each" in message
    assert "{'CPU': 2.0} in all, room for 2" in message
    assert "tensor_parallel_size=1" in message and "ray_per_worker_cpus=0.66" in message  # 6 heads: not 2
    assert not ray.util.list_named_actors()
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())
