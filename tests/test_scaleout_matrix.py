"""Issue 14's acceptance matrix: greedy outputs (fp32, near-tie rule) of each scale-out mode equal
those of TP=1 with sync scheduling in-process, on tiny Llama, Qwen3, Gemma3 and the embedded
model, with every KV block free afterwards; and a SIGKILL of a worker or core at the end of each
cell's run is an EngineDeadError in every caller within 2 s, with no orphan process and no
leftover /dev/shm segment.

One engine per (model, mode) cell; its kill check runs on the same engine after the greedy check.
Cells covered by other files are not repeated here (the table in docs/scaling-out.md):
  llama  tp2_mp              tests/executor/test_multiproc.py (worker kill, LLM caller)
  qwen3  tp2_mp              tests/executor/test_multiproc.py (worker kill, AsyncLLM caller)
  gemma3 tp2_mp (slow)       tests/executor/test_multiproc.py (core kill)
  llama  tp2_ray             tests/executor/test_ray_executor.py (actor kill)
  llama  dp2                 tests/frontend/test_dp_client.py (core kill)
  llama  async (in-process)  tests/frontend/test_async_scheduling.py
  embedded tp3_mp, dp2, async (slow) test_multiproc.py, test_dp_client.py, test_async_scheduling.py
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from lm_console.engine import LLM, AsyncLLM, SamplingParams
from lm_console.engine.errors import EngineDeadError
from llm_helpers import text_prompts

pytestmark = pytest.mark.slow

ARGS = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=128)
MAX_TOKENS = 10
TOP = 5  # logprobs per position for the near-tie rule
MIN_EXACT = 3  # of the 4 outputs, at least 3 exactly equal to TP=1 sync
NEAR_TIE_GAP = 0.01  # a near tie: TP=1's fp32 logprobs of the two tokens within this

RAY = dict(distributed_executor_backend="ray")
MODES: dict[str, dict[str, Any]] = {  # each mode's engine arguments
    "tp2_ray": dict(tensor_parallel_size=2, **RAY),
    "dp2": dict(data_parallel_size=2),
    # The core in its own process (as under `lmc serve`), its worker on a thread: 2 batches in flight.
    "async": dict(async_scheduling=True),
    "async_dp2": dict(async_scheduling=True, data_parallel_size=2),
    # The MultiprocExecutor's batch queue: max_concurrent_batches = 2 over worker processes.
    "async_tp2_mp": dict(async_scheduling=True, tensor_parallel_size=2),
    "async_tp2_ray": dict(async_scheduling=True, tensor_parallel_size=2, **RAY),
    "async_tp3_mp": dict(async_scheduling=True, tensor_parallel_size=3),
    # 4 usable blocks of 16 tokens (one request's max_model_len) for 4 requests of 6 to 50 tokens
    # (10 blocks): preemptions with a batch in flight, whichever request ends early.
    "async_tp2_mp_preempt": dict(async_scheduling=True, tensor_parallel_size=2, max_model_len=64,
                                 num_gpu_blocks_override=5),
    # Two engine cores of two worker processes each: a worker's death under DP.
    "dp2_tp2_mp": dict(data_parallel_size=2, tensor_parallel_size=2),
}

# (model, mode, what the kill at the end hits (None: no kill), its rank, AsyncLLM caller, slow).
# Engine start-up dominates: a core forks from the frontend's forkserver in about a second, while TP workers come
# from a fresh forkserver in the core (torch imported again: 15-30 s on the shared 2-core box) and
# Ray actors take as long; so the default run keeps one TP cell and the rest is slow.
CELLS = [
    ("qwen3", "async", "core", 0, False, False),
    ("qwen3", "dp2", "core", 0, True, False),
    ("gemma3", "async", "core", 0, True, False),
    ("gemma3", "dp2", "core", 1, False, False),
    ("llama", "async_dp2", "core", 1, False, True),
    ("qwen3", "async_tp2_mp", "worker", 0, True, False),
    ("llama", "async_tp2_mp_preempt", None, 0, False, True),
    ("gemma3", "async_tp2_mp", "core", 0, False, True),
    ("qwen3", "tp2_ray", "core", 0, False, True),
    ("gemma3", "tp2_ray", "worker", 0, True, True),
    ("llama", "async_tp2_ray", "worker", 1, True, True),
    ("embedded", "async_tp3_mp", "worker", 2, False, True),
    ("qwen3", "dp2_tp2_mp", "worker", 1, True, True),
]

MODEL_FIXTURES = {"llama": "tiny_llama_dir", "qwen3": "tiny_qwen3_dir", "gemma3": "tiny_gemma3_dir",
                  "embedded": "embedded_model_dir"}


def _cell_params() -> list[Any]:
    params = []
    for model, mode, kill, rank, async_caller, slow in CELLS:
        marks = [pytest.mark.slow] if slow else []
        params.append(pytest.param(model, mode, kill, rank, async_caller, marks=marks, id=f"{model}-{mode}"))
    return params


# -- the reference: TP=1, sync scheduling, engine core in-process, once per model -----------------
@dataclass
class Reference:
    prompts: list[list[int]]
    params: list[SamplingParams]
    token_ids: list[list[int]]
    top: list[list[dict[int, float]]]  # each position's top-TOP ids and their fp32 logprobs
    finish_reasons: list[str]


_REFERENCES: dict[str, Reference] = {}


def _params(stop_token: int | None) -> list[SamplingParams]:
    """Requests that finish at different steps (max_tokens 1, a stop token mid-output, the full
    length), so async scheduling finishes requests with a token in flight."""
    base = dict(temperature=0.0, ignore_eos=True, logprobs=TOP)
    return [SamplingParams(max_tokens=1, **base),
            SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop_token] if stop_token is not None else None,
                           **base),
            SamplingParams(max_tokens=MAX_TOKENS - 3, **base),
            SamplingParams(max_tokens=MAX_TOKENS, **base)]


def _reference(model: str, model_dir: Path) -> Reference:
    if model not in _REFERENCES:
        llm = LLM(str(model_dir), multiprocess=False, **ARGS)
        try:
            prompts = text_prompts(llm.get_tokenizer(), 4, 5, 40)
            free = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(None)[3], use_tqdm=False)
            params = _params(free[1].outputs[0].token_ids[4])  # prompt 1 stops at its 5th token
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            state = llm.get_block_pool_state()
            assert state.all_free
        finally:
            llm.shutdown()
        completions = [o.outputs[0] for o in outputs]
        _REFERENCES[model] = Reference(prompts, params, [c.token_ids for c in completions],
                                       [[{t: lp.logprob for t, lp in d.items()} for d in c.logprobs] for c in completions],
                                       [c.finish_reason for c in completions])
        assert _REFERENCES[model].finish_reasons[1] == "stop"
        assert len({tuple(t) for t in _REFERENCES[model].token_ids[1:]}) > 1  # not a degenerate model
    return _REFERENCES[model]


def _assert_close(completions: list[Any], ref: Reference) -> int:
    """Equal token ids, or at the first difference each side's token is in the other's top-5 and
    TP=1's logprobs of the two are within NEAR_TIE_GAP (a near tie; the rest of that output is not
    compared); and at least MIN_EXACT outputs exactly equal. Returns the number of exact matches."""
    exact = 0
    for i, completion in enumerate(completions):
        ours, theirs = completion.token_ids, ref.token_ids[i]
        if ours == theirs:
            exact += 1
            assert completion.finish_reason == ref.finish_reasons[i]
            continue
        pos = next((p for p, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        assert pos is not None, f"prompt {i}: lengths differ ({len(ours)} vs {len(theirs)})"
        top = ref.top[i][pos]
        gap = top[theirs[pos]] - top[ours[pos]] if ours[pos] in top else float("inf")
        assert gap <= NEAR_TIE_GAP and theirs[pos] in set(completion.logprobs[pos]), \
            f"prompt {i}: token {pos} differs ({ours[pos]} vs {theirs[pos]}), not a near tie (gap {gap:.4g})"
    assert exact >= MIN_EXACT, f"only {exact}/{len(completions)} outputs exactly equal to TP=1 sync"
    return exact


def test_negative_control_rank1_attention_zeroed_fails_assert_close(tiny_qwen3_dir: Path) -> None:
    """_assert_close on the output of an engine whose rank-1 heads lost their attention
    (tests/broken_variants.py, in-process) must fail."""
    from broken_variants import rank1_attention_zeroed

    ref = _reference("qwen3", tiny_qwen3_dir)
    with rank1_attention_zeroed():
        engine = LLM(str(tiny_qwen3_dir), multiprocess=False, **ARGS)
        try:
            completions = _generate(engine, ref)
        finally:
            engine.shutdown()
    with pytest.raises(AssertionError, match="not a near tie|exactly equal"):
        _assert_close(completions, ref)


# -- processes ------------------------------------------------------------------------------------
def _shm() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("psm_")}


def _mapped_segments(processes: list[psutil.Process]) -> set[str]:
    """The shared-memory segments these processes map (the MessageQueues' rings, named or
    already unlinked). Other jobs on the machine create segments too, so the leftover check
    looks at these names rather than at every new name in /dev/shm."""
    names: set[str] = set()
    for process in processes:
        try:
            with open(f"/proc/{process.pid}/maps") as maps:
                names.update(re.findall(r"/dev/shm/(psm_\w+)", maps.read()))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return names


def _core_pids(engine: Any) -> list[int]:
    client = engine.engine_core
    return list(client.core_pids) if hasattr(client, "core_pids") else [client.ready_info.pid]


def _mp_workers(core_pid: int) -> list[psutil.Process]:
    """The worker processes under an engine core (children of its forkserver, or spawned)."""
    return [p for p in psutil.Process(core_pid).children(recursive=True)
            if p.ppid() != core_pid or "spawn_main" in " ".join(p.cmdline())]


def _ray_workers(ray: Any, core_pid: int, tp: int) -> list[psutil.Process]:
    names = [f"lmc-worker-{core_pid}-dp0-tp{rank}" for rank in range(tp)]
    return [psutil.Process(ray.get(ray.get_actor(name).getpid.remote())) for name in names]


def _victim(engine: Any, args: dict[str, Any], kill: str, rank: int, ray: Any) -> int:
    core_pids = _core_pids(engine)
    if kill == "core":
        return core_pids[rank]
    if ray is not None:
        return _ray_workers(ray, core_pids[0], args["tensor_parallel_size"])[rank].pid
    workers = sorted(_mp_workers(core_pids[-1]), key=lambda p: p.create_time())  # DP: the last core's
    assert len(workers) == args["tensor_parallel_size"]
    return workers[rank].pid


# -- callers --------------------------------------------------------------------------------------
def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=180))


def _generate(engine: Any, ref: Reference) -> list[Any]:
    if isinstance(engine, LLM):
        outputs = engine.generate([{"prompt_token_ids": p} for p in ref.prompts], ref.params, use_tqdm=False)
        return [o.outputs[0] for o in outputs]

    async def one(i: int) -> Any:
        final = None
        async for out in engine.generate({"prompt_token_ids": ref.prompts[i]}, ref.params[i], f"m{i}"):
            final = out
        return final.outputs[0]

    async def all_() -> list[Any]:
        return list(await asyncio.gather(*(one(i) for i in range(len(ref.prompts)))))

    return _run(all_())


def _block_states(engine: Any) -> list[Any]:
    """Each engine core's BlockPoolState (DP: one per core)."""
    per_core = getattr(engine.engine_core, "get_block_pool_state_per_core", None)
    if per_core is not None:
        return per_core()
    if isinstance(engine, LLM):
        return [engine.get_block_pool_state()]
    return [_run(engine.get_block_pool_state())]


def _abort_mid_stream(engine: AsyncLLM, ref: Reference) -> None:
    """Abort two running requests (with async scheduling, while a batch holding them is in
    flight): their streams end, and every KV block comes back."""
    async def main() -> list[Any]:
        ids = [f"abort{i}" for i in range(2)]
        streams = [engine.generate({"prompt_token_ids": ref.prompts[i]}, LONG, ids[i]) for i in range(2)]
        for stream in streams:
            await stream.__anext__()
        await engine.abort(ids)
        finals = []
        for stream in streams:
            final = None
            async for out in stream:
                final = out
            finals.append(final)
        async def block_states() -> list[Any]:
            client = engine.engine_core
            if hasattr(client, "call_utility_futures"):  # DP: one state per core
                futures = client.call_utility_futures("get_block_pool_state")
                return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
            return [await engine.get_block_pool_state()]

        states = await block_states()
        for tries in range(100):  # a freed block may wait for the batch in flight (deferred frees)
            if all(s.all_free for s in states):
                print(f"all KV blocks free after the abort ({tries} polls)")
                break
            await asyncio.sleep(0.05)
            states = await block_states()
        assert [s.all_free for s in states] == [True] * len(states), "KV blocks leaked after an abort"
        return finals

    finals = _run(main())
    assert [f.outputs[0].finish_reason for f in finals] == ["abort", "abort"]
    assert all(len(f.outputs[0].token_ids) < LONG.max_tokens for f in finals)


LONG = SamplingParams(temperature=0.0, max_tokens=220, ignore_eos=True)


def _kill_llm_callers(llm: LLM, pid: int) -> float:
    """SIGKILL `pid` while one thread generates and another polls stats; both must get
    EngineDeadError. Returns the seconds from the kill to the generating caller's error."""
    errors: dict[str, BaseException] = {}
    caught_at: dict[str, float] = {}
    running = threading.Event()

    def generate() -> None:
        try:
            llm.generate([{"prompt_token_ids": [5, 6, 7 + i]} for i in range(4)], LONG, use_tqdm=False)
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            caught_at["generate"], errors["generate"] = time.monotonic(), error

    def poll() -> None:
        try:
            while True:
                if llm.get_stats().num_running_reqs > 0:
                    running.set()
                time.sleep(0.01)
        except BaseException as error:  # noqa: BLE001
            caught_at["poll"], errors["poll"] = time.monotonic(), error

    threads = [threading.Thread(target=generate), threading.Thread(target=poll)]
    for thread in threads:
        thread.start()
    assert running.wait(120), "the long requests never ran"
    time.sleep(0.2)  # a few steps in: batches in flight
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    assert all(isinstance(errors.get(k), EngineDeadError) for k in ("generate", "poll")), errors
    assert not any("\x1b" in str(e) for e in errors.values())  # no terminal colour codes (Ray's)
    return max(caught_at.values()) - killed_at


def _kill_async_callers(engine: AsyncLLM, pid: int) -> float:
    async def main() -> float:
        streams = [engine.generate({"prompt_token_ids": [5, 6, 7 + i]}, LONG, f"victim{i}") for i in range(2)]
        for stream in streams:
            await stream.__anext__()  # both requests are running

        async def drain(stream: Any) -> float:
            with pytest.raises(EngineDeadError) as error:
                async for _ in stream:
                    pass
            assert "\x1b" not in str(error.value)  # no terminal colour codes (Ray's)
            return time.monotonic()

        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        caught = await asyncio.gather(*(drain(s) for s in streams))
        with pytest.raises(EngineDeadError):
            await engine.get_stats()
        return max(caught) - killed_at

    return _run(main())


# -- the matrix -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("model", "mode_name", "kill", "rank", "async_caller"), _cell_params())
def test_greedy_equals_tp1_no_leaks_and_sigkill_is_engine_dead(
        request: pytest.FixtureRequest, model: str, mode_name: str, kill: str | None, rank: int,
        async_caller: bool) -> None:
    args = MODES[mode_name]
    ray = request.getfixturevalue("local_ray") if args.get("distributed_executor_backend") == "ray" else None
    model_dir = request.getfixturevalue(MODEL_FIXTURES[model])
    ref = _reference(model, model_dir)
    processes: list[psutil.Process] = []
    segments: set[str] = set()
    kwargs = dict(ARGS, **args)
    engine = (AsyncLLM(str(model_dir), stat_loggers=[], **kwargs) if async_caller
              else LLM(str(model_dir), **kwargs))
    try:
        completions = _generate(engine, ref)
        exact = _assert_close(completions, ref)
        print(f"{model} {mode_name}: {exact}/{len(completions)} outputs exactly equal to TP=1 sync")
        states = _block_states(engine)
        assert [s.all_free for s in states] == [True] * len(states), "KV blocks leaked"
        if async_caller:
            _abort_mid_stream(engine, ref)
        assert engine.config.scheduler_config.async_scheduling == bool(args.get("async_scheduling"))
        if mode_name.endswith("_preempt"):
            assert engine.get_stats().num_preemptions_total > 0

        core_pids = _core_pids(engine)
        if ray is not None:
            processes = [psutil.Process(p) for p in core_pids]
            processes += _ray_workers(ray, core_pids[0], args["tensor_parallel_size"])
        else:
            processes = [p for pid in core_pids
                         for p in (psutil.Process(pid), *psutil.Process(pid).children(recursive=True))]
        segments = _mapped_segments(processes)
        assert bool(segments) == (args.get("tensor_parallel_size", 1) > 1 and ray is None)  # mp: the queues
        if kill is not None:
            victim = _victim(engine, args, kill, rank, ray)
            waited = _kill_async_callers(engine, victim) if async_caller else _kill_llm_callers(engine, victim)
            print(f"{model} {mode_name}: EngineDeadError in every caller {waited:.2f} s after SIGKILL of "
                  f"{kill} {rank}")
            assert waited < 2.0
    finally:
        engine.shutdown()
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, f"orphan processes left: {alive}"
    assert not (segments & _shm()), "shared-memory segments left in /dev/shm"
    if ray is not None:
        assert not ray.util.list_named_actors()  # the core's actors went with it
