"""EngineConfig: frozen sub-configs, model facts resolved once, num_blocks decided once by the core;
EngineArgs._verify checks every argument's type and range before any process starts (issue 18 item 7)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lm_console.engine import LLM, AsyncLLM
from lm_console.engine.config import CacheConfig, DeviceConfig, EngineArgs, ModelConfig, ParallelConfig, SchedulerConfig
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.ipc import MsgpackEncoder
from lm_console.engine.protocol import EngineCoreReadyInfo

ROOT = Path(__file__).resolve().parent.parent


def test_sub_configs_are_frozen(tiny_llama_dir: Path) -> None:
    config = EngineArgs(model=str(tiny_llama_dir), device="cpu", dtype="float32").create_engine_config()
    for sub in (config, config.model_config, config.cache_config, config.scheduler_config,
                config.parallel_config, config.device_config):
        field = dataclasses.fields(sub)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(sub, field, getattr(sub, field))


def test_model_facts_are_resolved_once_as_plain_values(tiny_llama_dir: Path) -> None:
    from transformers import AutoConfig

    config = EngineArgs(model=str(tiny_llama_dir), device="cpu", dtype="bf16", max_model_len=64).create_engine_config()
    model, hf = config.model_config, AutoConfig.from_pretrained(tiny_llama_dir)
    assert model.model_dir == str(tiny_llama_dir) == model.tokenizer_dir
    assert (model.dtype, config.device_config.device) == ("bfloat16", "cpu")  # names, not torch objects
    assert model.architectures == tuple(hf.architectures) and not model.is_multimodal
    assert (model.num_layers, model.num_attention_heads, model.num_kv_heads) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads)
    assert model.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert (model.vocab_size, model.hidden_size, model.max_model_len) == (hf.vocab_size, hf.hidden_size, 64)
    assert model.max_position_embeddings == hf.max_position_embeddings
    # The transformers config is loaded in one place, once per process.
    assert model.hf_config is model.hf_config and model.hf_config.vocab_size == hf.vocab_size
    assert config.cache_config.num_blocks is None  # decided by the engine core, not here


def test_vlm_facts_are_the_language_models(tiny_gemma3_vlm_dir: Path) -> None:
    config = EngineArgs(model=str(tiny_gemma3_vlm_dir), device="cpu", dtype="float32").create_engine_config()
    text = config.model_config.hf_config.get_text_config()
    assert config.model_config.is_multimodal
    assert (config.model_config.num_layers, config.model_config.vocab_size, config.model_config.head_dim) == (
        text.num_hidden_layers, text.vocab_size, text.head_dim)


def test_max_model_len_beyond_the_model_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidEngineArgsError, match="exceeds the model's max_position_embeddings"):
        EngineArgs(model=str(tiny_llama_dir), device="cpu", max_model_len=1 << 20).create_engine_config()


def test_the_core_decides_num_blocks_once_without_mutating_the_config(tiny_llama_dir: Path) -> None:
    from lm_console.engine.core.engine_core import EngineCore

    config = EngineArgs(model=str(tiny_llama_dir), device="cpu", num_gpu_blocks_override=40,
                        max_model_len=128).create_engine_config()
    core = EngineCore(config)
    try:
        assert config.cache_config.num_blocks is None
        assert core.config.cache_config.num_blocks == 40 == core.kv_cache_manager.block_pool.num_gpu_blocks
        assert core.config == config.with_num_blocks(40)
    finally:
        core.shutdown()


_FRONTEND = """
import sys
from lm_console.engine.config import EngineArgs
from lm_console.engine.ipc import MsgpackDecoder
from lm_console.engine.protocol import EngineCoreReadyInfo

info = MsgpackDecoder(EngineCoreReadyInfo).decode([sys.stdin.buffer.read()])
config = EngineArgs(model="ignored").create_frontend_config(info)
model = config.model_config
print(model.model_name, model.dtype, model.num_kv_heads, config.cache_config.num_blocks,
      config.device_config.device, "torch" in sys.modules)
"""


def test_the_frontend_builds_its_config_from_the_handshake_without_torch() -> None:
    model = ModelConfig(model_name="tiny", model_dir="/models/tiny", tokenizer_dir="/models/tiny",
                        architectures=("LlamaForCausalLM",), is_multimodal=False, dtype="bfloat16", seed=0,
                        max_model_len=128, max_position_embeddings=256, vocab_size=100, hidden_size=64,
                        num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16)
    info = EngineCoreReadyInfo(model_config=model, cache_config=CacheConfig(num_blocks=33),
                               scheduler_config=SchedulerConfig(), device_config=DeviceConfig(device="cpu"))
    (payload,) = MsgpackEncoder().encode(info)
    result = subprocess.run([sys.executable, "-c", _FRONTEND], input=bytes(payload), capture_output=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split() == ["tiny", "bfloat16", "2", "33", "cpu", "False"]
    config = EngineArgs().create_frontend_config(info)
    assert config.model_config == model and config.parallel_config == ParallelConfig()


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
