"""data_parallel_backend="ray" over a local Ray instance: two engine cores as Ray actors behind
one frontend give DP=1's greedy tokens, both serve requests, neither leaks a KV block, and a
core actor's SIGKILL is an EngineDeadError in every caller with no actor or process left."""

from __future__ import annotations

import os
import threading
import time

import pytest

# Set before Ray loads: a single-machine instance on 127.0.0.1 (Ray otherwise uses the machine's address).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="the [ray] extra installs Ray")

from lm_console.engine import LLM, EngineArgs, SamplingParams  # noqa: E402
from lm_console.engine.errors import EngineDeadError, InvalidEngineArgsError  # noqa: E402
from lm_console.engine.executor.ray_utils import WorkerNodeInfo  # noqa: E402
from lm_console.engine.frontend.dp_client import SyncDPClient  # noqa: E402
from lm_console.engine.frontend.dp_ray import RayEngineProcess, core_bundle, frontend_host  # noqa: E402
from llm_helpers import assert_all_equal, random_prompts, sigkill_during_generate  # noqa: E402

pytestmark = pytest.mark.slow

ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, block_size=16, device="cpu")


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt's greedy tokens and its prefix-cache hit (in tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.num_cached_tokens) for o in outputs]


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_core_bundle_and_frontend_host() -> None:
    cpu = EngineArgs(device="cpu", tensor_parallel_size=2, data_parallel_size=2)
    assert core_bundle(cpu, {"CPU": 8.0}) == {"CPU": 2.0}
    assert core_bundle(EngineArgs(tensor_parallel_size=2), {"CPU": 8.0, "GPU": 4.0}) == {"GPU": 2.0}
    assert core_bundle(EngineArgs(distributed_executor_backend="ray", tensor_parallel_size=2),
                       {"GPU": 4.0}) == {"CPU": 1.0}  # the core's workers reserve their own GPUs
    assert frontend_host(["a", "a"], "a", "10.0.0.1") is None  # one machine: ipc / loopback
    assert frontend_host(["a", "b"], "a", "10.0.0.1") == "10.0.0.1"  # tcp + CURVE on this node


def test_a_core_removes_the_socket_dir_of_a_frontend_that_is_gone(tmp_path) -> None:
    """Ray ends the core actors of a dead frontend with SIGKILL; their watcher cleans up first."""
    import subprocess
    import sys

    from lm_console.engine.frontend.dp_ray import _remove_when_gone

    socket_dir = tmp_path / "lmc-engine-x"
    socket_dir.mkdir()
    frontend = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    watcher = threading.Thread(target=_remove_when_gone, args=(frontend.pid, str(socket_dir)))
    watcher.start()
    assert socket_dir.exists()
    frontend.kill()
    watcher.join(30)  # returns once the process is gone (and reaped below if need be)
    frontend.wait()
    watcher.join()
    assert not socket_dir.exists()


def test_ray_cores_need_multiprocess() -> None:
    with pytest.raises(InvalidEngineArgsError, match="multiprocess=True"):
        LLM(None, data_parallel_backend="ray", multiprocess=False)  # even one core would be an actor


def test_a_core_on_another_node_gets_curve_tcp_sockets() -> None:
    """The frontend binds tcp with CURVE on its node's address; the core's KV-events PUB on the core's."""
    args = EngineArgs(data_parallel_size=2, data_parallel_backend="ray", enable_kv_cache_events=True)
    resources = RayEngineProcess(args, actor=None, node=WorkerNodeInfo("other", "127.0.0.2", 1), host="127.0.0.1",
                                 name="lmc-core-test")
    try:
        addresses = resources.addresses
        assert addresses.input_address.startswith("tcp://127.0.0.1:") and not addresses.input_address.endswith(":*")
        assert addresses.output_addresses[0].startswith("tcp://127.0.0.1:") and addresses.curve is not None
        assert addresses.kv_events_endpoint == "tcp://127.0.0.2:*" and addresses.ipc_dir is None
    finally:
        resources.close()
    same_node = RayEngineProcess(EngineArgs(), actor=None, node=WorkerNodeInfo("here", "127.0.0.1", 1), host=None,
                                 name="lmc-core-test")
    try:
        assert same_node.addresses.input_address.startswith("ipc://") and same_node.addresses.curve is None
        assert os.stat(same_node.addresses.ipc_dir).st_mode & 0o777 == 0o700
    finally:
        same_node.close()


def test_dp2_over_ray_equals_dp1_and_a_dead_core_actor_fails_every_caller(local_ray, tiny_llama_dir) -> None:
    single = LLM(str(tiny_llama_dir), multiprocess=False, **ARGS)
    prompts = random_prompts(single.config.model_config.vocab_size, 6, 5, 60, seed=11)
    expected = [_greedy(single, prompts) for _ in range(2)]  # the second pass on prefix-cache hits
    single.shutdown()
    assert any(cached for _, cached in expected[1])
    llm = LLM(str(tiny_llama_dir), data_parallel_size=2, data_parallel_backend="ray",
              data_parallel_routing="prefix", **ARGS)
    client = llm.engine_core
    try:
        assert isinstance(client, SyncDPClient)
        assert all(isinstance(resources, RayEngineProcess) for resources in client.group.resources)
        core_pids = client.core_pids
        assert core_pids == [info.pid for info in client.ready_infos] and os.getpid() not in core_pids
        names = sorted(ray.util.list_named_actors())
        assert names == [f"lmc-core-{os.getpid()}-dp0", f"lmc-core-{os.getpid()}-dp1"]
        # Twice: the second pass goes back to each prompt's core, which the frontend knows from
        # that core's KV events (prefix routing), and hits its prefix cache.
        assert_all_equal([_greedy(llm, prompts) for _ in range(2)], expected, "DP=2 over Ray vs DP=1")
        routed = [core["num_routed"] for core in client.router.snapshot()]
        assert routed == [6, 6]
        per_core = client.get_stats_per_core()
        assert [stats.engine_index for stats in per_core] == [0, 1]
        assert all(stats.num_steps > 0 for stats in per_core)
        assert [state.all_free for state in client.get_block_pool_state_per_core()] == [True, True]

        error, waited = sigkill_during_generate(
            llm, lambda: sum(s.num_running_reqs for s in client.get_stats_per_core()) >= 4, core_pids[1])
        assert isinstance(error, EngineDeadError)
        assert "Ray actor lmc-core-" in str(error) and waited < 2.0
        with pytest.raises(EngineDeadError):
            llm.get_stats()
    finally:
        llm.shutdown()
    assert not ray.util.list_named_actors()
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())
    deadline = time.monotonic() + 10
    while any(_pid_exists(pid) for pid in core_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_pid_exists(pid) for pid in core_pids)
