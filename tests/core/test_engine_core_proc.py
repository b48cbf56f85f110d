"""EngineCoreProc: malformed input frames are rejected, and the core never outlives its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.errors import EngineError
from lm_console.engine.ipc import MsgpackEncoder
from lm_console.engine.protocol import EngineCoreRequestType, UtilityCall
from llm_helpers import assert_no_leaked_blocks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _is_gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status  # a zombie has exited; only its reaping is pending


def test_malformed_frames_are_rejected_and_the_engine_keeps_serving(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = llm.generate("garbage in", params, use_tqdm=False)[0].outputs[0].token_ids
    resources = llm.engine_core.resources
    add, abort, utility = (t.frame() for t in (EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT,
                                                EngineCoreRequestType.UTILITY))
    tensor_ext = msgspec.msgpack.Ext(1, msgspec.msgpack.encode(("numpy", "float32", [2], 5)))
    garbage = [
        [b""],  # no type byte
        [b"\x09", b"x"],  # unknown type
        [EngineCoreRequestType.READY.frame(), b"\xc0"],  # a core -> frontend type
        [add, b"\xff\xfe not msgpack"],
        [add, msgspec.msgpack.encode([1, 2, 3])],  # wrong schema
        [add, msgspec.msgpack.encode([["id", [1, 2], tensor_ext]])],  # tensor frame missing
        [abort],  # no payload
        [abort, msgspec.msgpack.encode({"not": "a list"})],
        [utility, msgspec.msgpack.encode(UtilityCall(1, 5, "get_stats"))],  # no such client
        [os.urandom(64) for _ in range(3)],
    ]
    with resources.send_lock:
        for frames in garbage:
            resources.input_socket.send_multipart([resources.core_identity, *frames])
    with pytest.raises(EngineError, match="unknown utility method"):
        llm.engine_core.call_utility("shutdown_everything")
    after = llm.generate("garbage in", params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before and llm.engine_core.proc.is_alive()
    assert_no_leaked_blocks(llm)
    llm.shutdown()


def test_a_request_the_core_rejects_comes_back_aborted(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
    _, request = llm.input_processor.process_inputs("same", "hi", SamplingParams(max_tokens=50, ignore_eos=True))
    llm.engine_core.add_request(request)
    llm.engine_core.add_request(request)  # duplicate id: rejected by the core
    seen = []
    while len(seen) < 2:
        seen += [o for o in llm.engine_core.get_output().outputs if o.finished]
    assert seen[0].finish_reason == 2 and "already in the engine" in seen[0].stop_reason
    assert_no_leaked_blocks(llm)
    llm.shutdown()


def test_the_core_exits_when_its_parent_dies(tiny_llama_dir) -> None:
    script = (
        "import sys, time\n"
        "from lm_console.engine import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tiny_llama_dir)!r}, dtype='float32', max_model_len=128, num_gpu_blocks_override=64)\n"
        "    print(llm.engine_core.proc.pid, llm.engine_core.resources.addresses.ipc_dir, flush=True)\n"
        "    time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        pid_text, ipc_dir = parent.stdout.readline().split()
        core_pid = int(pid_text)
        assert not _is_gone(core_pid) and os.path.isdir(ipc_dir)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while not _is_gone(core_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _is_gone(core_pid), "the engine core outlived its parent"
        assert not os.path.exists(ipc_dir), "the core removes the dead frontend's socket dir"
    finally:
        parent.kill()


def test_sigterm_to_the_process_group_removes_the_socket_dir(tiny_llama_dir) -> None:
    """Issue 18 item 8: `timeout` SIGTERMs the whole group; on main the ipc dir was left behind."""
    script = (
        "import time\n"
        "from lm_console.engine import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tiny_llama_dir)!r}, dtype='float32', max_model_len=128, num_gpu_blocks_override=64)\n"
        "    print(llm.engine_core.proc.pid, llm.engine_core.resources.addresses.ipc_dir, flush=True)\n"
        "    time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              start_new_session=True, env={**os.environ, "LMC_ENGINE_START_METHOD": "spawn"})
    try:
        pid_text, ipc_dir = parent.stdout.readline().split()
        core_pid = int(pid_text)
        assert os.path.isdir(ipc_dir) and os.getpgid(core_pid) == parent.pid
        os.killpg(parent.pid, signal.SIGTERM)
        parent.wait()
        deadline = time.monotonic() + 10
        while not (_is_gone(core_pid) and not os.path.exists(ipc_dir)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _is_gone(core_pid) and not os.path.exists(ipc_dir), "the socket dir outlived the engine"
    finally:
        parent.kill()
