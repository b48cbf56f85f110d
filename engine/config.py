"""EngineArgs (user-facing knobs) -> EngineConfig (resolved model, cache and scheduler settings)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.distributed.kv_transfer.config import KVTransferConfig
from engine.errors import InvalidEngineArgsError

if TYPE_CHECKING:
    from engine.protocol import EngineCoreReadyInfo


@dataclass
class EngineArgs:
    """Every engine argument that `LLM(model, **engine_args)` and the `lmc` flags accept."""

    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    seed: int = 0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings (capped)
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256_cbor"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    kv_cache_memory: int | None = None  # bytes of KV cache on CPU
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    device: str = "auto"  # auto | cpu | cuda
    num_threads: int | None = None  # torch intra-op threads on CPU (default: all cores)
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    enable_kv_cache_events: bool = False
    kv_events_endpoint: str | None = None  # the PUB socket's address (default: a private ipc path)
    log_stats: bool = True
    # The engine core in its own process (default; $LMC_MULTIPROCESS=0 flips it), or in this one.
    multiprocess: bool = field(default_factory=lambda: os.environ.get("LMC_MULTIPROCESS", "1") != "0")
    zmq_transport: str = "ipc"  # ipc (private 0700 temp dir) | tcp (loopback)
    # Multimodal (engine/multimodal/config.py) and encoder-cache transfer (engine/distributed/ec_transfer).
    mm_processor_cache_gb: float = 1.0
    mm_hasher_algorithm: str = "auto"
    disable_chunked_mm_input: bool = False
    encoder_cache_size: int | None = None
    max_num_encoder_input_tokens: int | None = None
    ec_transfer_config: dict[str, Any] | str | None = None  # dict or JSON string
    # KV connector (engine/distributed/kv_transfer): a dict or JSON string, e.g.
    # {"kv_connector": "OffloadConnector", "kv_role": "kv_both", "kv_connector_extra_config": {...}}.
    kv_transfer_config: Any = None
    # Reliability (issue 18): logprobs per token a request may ask for (vLLM's max_logprobs;
    # -1: no limit), and how long the frontend waits for the engine core's heartbeat before it
    # declares the core unresponsive (EngineUnresponsiveError; None: never).
    max_logprobs: int = 20
    liveness_timeout_s: float | None = 30.0

    def create_engine_config(self) -> EngineConfig:
        """Validate the arguments, resolve the model and build the EngineConfig."""
        self._verify()
        from engine.models.embedded import resolve_model_path
        from engine.platform import detect_device, resolve_dtype

        model_dir = resolve_model_path(self.model)
        hf_config = _load_hf_config(model_dir)
        device = detect_device() if self.device == "auto" else _torch_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        model_max = int(getattr(text_config, "max_position_embeddings", 2048) or 2048)
        max_model_len = self.max_model_len or min(model_max, 8192)
        if max_model_len > model_max:
            raise InvalidEngineArgsError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}."
            )
        max_num_batched_tokens = self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        return EngineConfig(
            model_dir=model_dir,
            tokenizer_dir=Path(self.tokenizer) if self.tokenizer else model_dir,
            model_name=self.model or "SmolLM2-135M-Instruct",
            hf_config=hf_config,
            dtype=dtype,
            device=device,
            seed=self.seed,
            max_model_len=max_model_len,
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            num_threads=self.num_threads,
            enable_kv_cache_events=self.enable_kv_cache_events,
            log_stats=self.log_stats,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            mm_config=self.create_mm_config(),
            ec_transfer_config=self.create_ec_transfer_config(),
            kv_transfer_config=KVTransferConfig.parse(self.kv_transfer_config),
        )

    def create_mm_config(self) -> Any:
        """The resolved MultiModalConfig (validated)."""
        from engine.multimodal.config import MultiModalConfig

        mm_config = MultiModalConfig(
            mm_processor_cache_gb=self.mm_processor_cache_gb, mm_hasher_algorithm=self.mm_hasher_algorithm,
            disable_chunked_mm_input=self.disable_chunked_mm_input, encoder_cache_size=self.encoder_cache_size,
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens)
        mm_config.verify()
        return mm_config

    def create_ec_transfer_config(self) -> Any:
        """ECTransferConfig from ec_transfer_config (dict or JSON string), or None."""
        if self.ec_transfer_config is None:
            return None
        from engine.distributed.ec_transfer.config import ECTransferConfig

        return ECTransferConfig.from_arg(self.ec_transfer_config)

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> EngineArgs:
        """Build EngineArgs, naming unknown arguments in the error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidEngineArgsError(
                f"Unknown engine argument(s) {unknown}; allowed: {sorted(names - {'model'})}."
            )
        return cls(model=model, **kwargs)

    def _verify(self) -> None:
        """Check every argument's type and range (bool is not an int; InvalidEngineArgsError)."""
        def fail(name: str, allowed: str) -> None:
            value = repr(getattr(self, name))
            raise InvalidEngineArgsError(f"{name}={value[:80]} is invalid: {allowed}.")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63

        def is_number(value: object) -> bool:
            return (is_int(value) or isinstance(value, float)) and not isinstance(value, bool) \
                and math.isfinite(value)

        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                     "kv_cache_memory", "num_gpu_blocks_override", "num_threads", "max_num_encoder_input_tokens",
                     "encoder_cache_size"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                fail(name, "it must be an integer in [1, 2**63)")
        for name in ("model", "tokenizer", "kv_events_endpoint"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                fail(name, "it must be a str or None")
        for name in ("dtype", "device", "attention_backend", "zmq_transport", "prefix_caching_hash_algo",
                     "mm_hasher_algorithm", "distributed_executor_backend"):
            if hasattr(self, name) and not isinstance(getattr(self, name), str):
                fail(name, "it must be a str")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "enable_kv_cache_events",
                     "log_stats", "multiprocess", "disable_chunked_mm_input"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "it must be True or False")
        if not is_int(self.seed):
            fail("seed", "it must be an integer in the signed 64-bit range")
        if not is_int(self.max_logprobs) or self.max_logprobs < -1:
            fail("max_logprobs", "it must be an integer >= 0, or -1 for no limit")
        if self.liveness_timeout_s is not None and (not is_number(self.liveness_timeout_s)
                                                    or self.liveness_timeout_s <= 0):
            fail("liveness_timeout_s", "it must be a finite number of seconds > 0, or None to never time out")
        if not is_number(self.mm_processor_cache_gb) or self.mm_processor_cache_gb < 0:
            fail("mm_processor_cache_gb", "it must be a finite number >= 0")
        if self.block_size & (self.block_size - 1):
            raise InvalidEngineArgsError(f"block_size={self.block_size} must be a power of two.")
        if not is_number(self.gpu_memory_utilization) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidEngineArgsError(
                f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be a number in (0, 1]."
            )
        if self.kv_cache_memory is not None:
            total = _physical_memory_bytes()
            if total is not None and self.kv_cache_memory > total:
                fail("kv_cache_memory", f"it exceeds this machine's memory ({total} bytes)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise InvalidEngineArgsError(f"device={self.device!r} must be one of auto, cpu, cuda.")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise InvalidEngineArgsError(
                f"attention_backend={self.attention_backend!r} must be one of auto, torch, triton.")
        if self.zmq_transport not in ("ipc", "tcp"):
            raise InvalidEngineArgsError(f"zmq_transport={self.zmq_transport!r} must be one of ipc, tcp.")
        KVTransferConfig.parse(self.kv_transfer_config)  # fail in the frontend, before any process starts

    def create_frontend_config(self, info: EngineCoreReadyInfo) -> EngineConfig:
        """The frontend's EngineConfig, from the core's ready handshake: no torch involved.

        dtype and device are names (str); hf_config is config.json as a namespace.
        """
        self._verify()
        model_dir = Path(info.model_dir)
        hf_config = types.SimpleNamespace(**json.loads((model_dir / "config.json").read_text()))
        hf_config.vocab_size = info.vocab_size
        return EngineConfig(
            model_dir=model_dir, tokenizer_dir=Path(info.tokenizer_dir), model_name=info.model_name,
            hf_config=hf_config, dtype=info.dtype, device=info.device, seed=self.seed,
            max_model_len=info.max_model_len, block_size=info.block_size,
            enable_prefix_caching=info.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            max_num_batched_tokens=info.max_num_batched_tokens, max_num_seqs=info.max_num_seqs,
            kv_cache_memory=self.kv_cache_memory, gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override, num_threads=self.num_threads,
            enable_kv_cache_events=self.enable_kv_cache_events, log_stats=self.log_stats,
            num_blocks=info.num_blocks, mm_config=self.create_mm_config(),
            ec_transfer_config=self.create_ec_transfer_config(),
        )


@dataclass
class EngineConfig:
    """Resolved configuration shared by the scheduler, the KV cache manager and the worker."""

    model_dir: Path
    tokenizer_dir: Path
    model_name: str
    hf_config: Any
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    seed: int
    max_model_len: int
    block_size: int
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None
    num_threads: int | None
    enable_kv_cache_events: bool
    log_stats: bool
    num_blocks: int = 0  # filled in by EngineCore after profiling the KV budget
    attention_backend: str = "auto"  # auto | torch | triton (engine/attention/selector.py)
    enforce_eager: bool = False  # no CUDA graphs
    kv_transfer_config: KVTransferConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    mm_config: Any = None  # engine.multimodal.config.MultiModalConfig
    ec_transfer_config: Any = None  # engine.distributed.ec_transfer.config.ECTransferConfig | None

    @property
    def text_config(self) -> Any:
        """The language model's config (a VLM's text_config; the config itself otherwise)."""
        hf = self.hf_config
        if hasattr(hf, "get_text_config"):
            return hf.get_text_config()
        return hf


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _torch_device(name: str) -> Any:
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidEngineArgsError("device='cuda' was requested but no CUDA device is available.")
    return torch.device(name)
