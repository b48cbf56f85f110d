"""EngineArgs._verify: every argument's type and range is checked before any process starts (issue 18 item 7)."""

from __future__ import annotations

import math

import pytest

from engine import LLM, AsyncLLM
from engine.config import EngineArgs
from engine.errors import InvalidEngineArgsError


@pytest.mark.parametrize("kwargs", [
    dict(block_size=True),  # on main: a bare msgspec error from the handshake
    dict(seed="abc"),  # on main: ValueError
    dict(zmq_transport="udp"),  # on main: ValueError from the address maker
    dict(kv_cache_memory=2**70),  # on main: RuntimeError from the core's allocation
    dict(kv_cache_memory=2**62),  # more than this machine has
    dict(max_num_seqs=1.5), dict(enable_prefix_caching="yes"), dict(gpu_memory_utilization=math.nan),
    dict(max_logprobs=-5), dict(liveness_timeout_s=0), dict(liveness_timeout_s=math.inf), dict(dtype=16),
])
def test_bad_engine_args_fail_before_the_engine_starts(kwargs) -> None:
    with pytest.raises(InvalidEngineArgsError):
        EngineArgs(**kwargs)._verify()
    with pytest.raises(InvalidEngineArgsError):
        LLM("/nonexistent/model", **kwargs)
    with pytest.raises(InvalidEngineArgsError):
        AsyncLLM("/nonexistent/model", **kwargs)


def test_defaults_verify() -> None:
    args = EngineArgs()
    args._verify()
    assert args.max_logprobs == 20 and args.liveness_timeout_s == 30.0
    EngineArgs(max_logprobs=-1, liveness_timeout_s=None)._verify()
