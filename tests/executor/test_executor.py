"""The Executor interface: the backend registry, the argument checks, and UniProcExecutor's RPC."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

from lm_console.engine.config import EngineArgs, ParallelConfig
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.executor.abstract import EXECUTOR_BACKENDS, Executor
from lm_console.engine.kv_cache_interface import FullAttentionSpec


def _config(backend: str) -> types.SimpleNamespace:
    # get_class reads only parallel_config.
    return types.SimpleNamespace(parallel_config=ParallelConfig(distributed_executor_backend=backend))


def test_uni_is_the_default_backend() -> None:
    from lm_console.engine.executor.uniproc import UniProcExecutor

    assert ParallelConfig().distributed_executor_backend == "uni"
    assert EngineArgs().create_parallel_config() == ParallelConfig()
    assert Executor.get_class(_config("uni")) is UniProcExecutor


def test_fake_backend_names_the_fake_executor() -> None:
    assert EXECUTOR_BACKENDS["fake"] == "lm_console.engine.executor.fake:FakeExecutor"
    if importlib.util.find_spec("lm_console.engine.executor.fake") is None:
        pytest.skip("lm_console/engine/executor/fake.py is not in this tree")
    from lm_console.engine.executor.fake import FakeExecutor

    assert Executor.get_class(_config("fake")) is FakeExecutor


def test_tp_above_one_switches_uni_to_mp() -> None:
    assert EngineArgs(tensor_parallel_size=2).create_parallel_config().distributed_executor_backend == "mp"
    assert EngineArgs(distributed_executor_backend="mp").create_parallel_config().distributed_executor_backend == "mp"


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(InvalidEngineArgsError, match="distributed_executor_backend='bogus'.*one of 'uni', 'fake', 'mp', 'ray'"):
        Executor.get_class(_config("bogus"))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"distributed_executor_backend": "threads"}, "'threads' is invalid: it must be one of 'uni', 'fake', 'mp', 'ray'"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "fake"}, "needs real workers"),
    ({"data_parallel_size": 0}, r"data_parallel_size=0 is invalid: it must be an integer >= 1 and <= 64"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 is invalid: it must be an integer >= 1"),
])
def test_engine_args_refuse_what_is_not_supported(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidEngineArgsError, match=message):
        EngineArgs(**kwargs).create_engine_config()


def test_uniproc_executor_runs_rpcs_on_its_worker(tiny_llama_dir: Path) -> None:
    from lm_console.engine.executor.uniproc import UniProcExecutor

    config = EngineArgs(model=str(tiny_llama_dir), kv_cache_memory=1 << 20, device="cpu",
                        multiprocess=False).create_engine_config()
    executor = Executor.get_class(config)(config)
    try:
        assert isinstance(executor, UniProcExecutor)
        block_bytes = executor.get_kv_cache_block_bytes()
        assert block_bytes > 0
        assert executor.determine_num_available_blocks() == (1 << 20) // block_bytes
        specs = executor.get_kv_cache_spec()
        assert len(specs) == config.model_config.num_layers
        assert all(spec == FullAttentionSpec(block_size=16) for spec in specs.values())
        # A function runs with the worker as its first argument; kwargs pass through.
        assert executor.collective_rpc(lambda worker, x, y=0: (worker is executor.worker, x + y),
                                       args=(1,), kwargs={"y": 2}) == [(True, 3)]
        executor.check_health()
    finally:
        executor.shutdown()
