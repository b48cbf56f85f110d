"""EngineArgs: the user-facing knobs, validated and resolved into an EngineConfig.

create_engine_config runs where the engine core runs (it resolves the model and the device);
the frontend rebuilds its config from the core's ready handshake (create_frontend_config).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lm_console.engine import envs
from lm_console.engine.config.cache import KV_CACHE_DTYPE_CHOICES, CacheConfig, resolve_kv_cache_dtype
from lm_console.engine.config.device import DeviceConfig
from lm_console.engine.config.engine_config import EngineConfig
from lm_console.engine.config.lora import LoRAConfig
from lm_console.engine.config.model import ModelConfig
from lm_console.engine.config.parallel import ParallelConfig
from lm_console.engine.config.scheduler import SchedulerConfig
from lm_console.engine.distributed.kv_transfer.config import KVTransferConfig
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.platform import cpu_has_int8_dot

if TYPE_CHECKING:
    from lm_console.engine.distributed.ec_transfer.config import ECTransferConfig
    from lm_console.engine.multimodal.config import MultiModalConfig
    from lm_console.engine.protocol import EngineCoreReadyInfo


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
    async_scheduling: bool = False  # schedule step N+1 while step N runs (AsyncScheduler, core/sched/scheduler.py)
    kv_cache_memory: int | None = None  # bytes of KV cache on CPU
    kv_cache_prefault: bool = False  # touch the CPU KV cache's pages at start-up (CacheConfig)
    # auto | int8 | the model's dtype: "auto" picks int8 where the weights run quantized on the
    # CPU (resolve_kv_cache_dtype), the model's dtype elsewhere.
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    device: str = "auto"  # auto | cpu | cuda
    num_threads: int | None = None  # torch intra-op threads on CPU (default: all cores)
    attention_backend: str = "auto"  # auto (triton on CUDA, cpu on CPU) | cpu (C kernels) | torch | triton
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    enable_kv_cache_events: bool = False
    kv_events_endpoint: str | None = None  # the PUB socket's address (default: a private ipc path)
    # Request features (issue 15): the WAITING queue's order ("fcfs" | "priority": lower
    # `priority` first, ties by arrival) and sampled block-lifetime metrics (block_metrics.py).
    scheduling_policy: str = "fcfs"
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01
    log_stats: bool = True
    # The engine core in its own process (default; $LMC_MULTIPROCESS=0 flips it), or in this one.
    multiprocess: bool = field(default_factory=lambda: envs.LMC_MULTIPROCESS.get() != "0")
    zmq_transport: str = "ipc"  # ipc (private 0700 temp dir) | tcp (loopback)
    # Multimodal (lm_console/engine/multimodal/config.py) and encoder-cache transfer (lm_console/engine/distributed/ec_transfer).
    mm_processor_cache_gb: float = 1.0
    mm_hasher_algorithm: str = "auto"
    disable_chunked_mm_input: bool = False
    encoder_cache_size: int | None = None
    max_num_encoder_input_tokens: int | None = None
    ec_transfer_config: dict[str, Any] | str | None = None  # dict or JSON string
    # KV connector (lm_console/engine/distributed/kv_transfer): a dict or JSON string, e.g.
    # {"kv_connector": "OffloadConnector", "kv_role": "kv_both", "kv_connector_extra_config": {...}}.
    kv_transfer_config: Any = None
    # Parallelism (lm_console/engine/executor/): one worker for now. "fake" runs no model (FakeExecutor).
    # uni | fake | mp (one worker process per tensor-parallel rank; tp > 1 with uni switches to mp) | ray
    distributed_executor_backend: str = "uni"
    tensor_parallel_size: int = 1
    # Data parallelism (lm_console/engine/frontend/dp_client.py): data_parallel_size engine cores behind one
    # frontend; each core's data_parallel_rank is set by the DP client (leave it at 0).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_backend: str = "mp"  # mp (one process per core) | ray (one Ray actor per core)
    data_parallel_routing: str = "least_loaded"  # least_loaded | prefix (prefer the longest cached prefix)
    # CPUs each Ray worker actor reserves (distributed_executor_backend="ray"; None: 1 on the CPU,
    # none on CUDA). A fraction lets more ranks than the cluster has CPUs share them, e.g.
    # tensor_parallel_size=3 with 0.5 on a 2-CPU machine (the ranks' threads then share the cores).
    ray_per_worker_cpus: float | None = None
    # Reliability (issue 18): logprobs per token a request may ask for (vLLM's max_logprobs;
    # -1: no limit), and how long the frontend waits for the engine core's heartbeat before it
    # declares the core unresponsive (EngineUnresponsiveError; None: never).
    max_logprobs: int = 20
    liveness_timeout_s: float | None = 30.0
    # Quantized CPU inference (lm_console/engine/models/quant/): None = auto (a GGUF model in bf16 on the CPU keeps
    # its file's weights, the fastest measured; LMC_QUANT_AUTO=0: dense), "gguf", "int8" (per-channel
    # int8 weights, dynamic int8 activations, any model) or "none" (always dense).
    quantization: str | None = None
    # Multi-LoRA serving (lm_console/engine/config/lora.py; vLLM's flags).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def create_engine_config(self) -> EngineConfig:
        """Validate, resolve the model (converting or building it on first use) and the device.

        The engine core's config: it runs where the engine core runs. The frontend builds its
        own from the core's ready handshake (create_frontend_config), without torch.
        """
        self._verify()
        from lm_console.engine.models.embedded import resolve_model_path
        from lm_console.engine.platform import detect_device, resolve_dtype

        model_dir = str(resolve_model_path(self.model))
        if self.device != "auto":
            device = self.device
        elif self.distributed_executor_backend == "fake":
            device = "cpu"  # no model runs, so no GPU is needed (and torch is not imported)
        else:
            device = detect_device()
        if device == "cuda" and detect_device() != "cuda":
            raise InvalidEngineArgsError("device='cuda' was requested but no CUDA device is available.")
        dtype = resolve_dtype(self.dtype, device)
        model_config = ModelConfig.from_model_dir(
            model_dir, model_name=self.model or "SmolLM2-135M-Instruct",
            tokenizer_dir=self.tokenizer or model_dir, dtype=dtype, seed=self.seed,
            max_model_len=self.max_model_len,
            # Tensor parallelism slices dense weights only: auto then stays dense.
            quantization=resolve_quantization("none" if self.tensor_parallel_size > 1 else self.quantization,
                                              model_dir, dtype, device,
                                              self.distributed_executor_backend))
        _verify_tensor_parallel(model_config, self.tensor_parallel_size)
        kv_cache_dtype = resolve_kv_cache_dtype(
            self.kv_cache_dtype, dtype=dtype, device=device, quantization=model_config.quantization,
            head_dim=model_config.head_dim, num_heads=model_config.num_attention_heads // self.tensor_parallel_size,
            num_kv_heads=model_config.num_kv_heads // self.tensor_parallel_size, block_size=self.block_size,
            attention_backend=self.attention_backend)
        max_num_batched_tokens = self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            max_num_batched_tokens = max(max_num_batched_tokens, model_config.max_model_len)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo, kv_cache_memory=self.kv_cache_memory,
                kv_cache_prefault=self.kv_cache_prefault, kv_cache_dtype=kv_cache_dtype,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_kv_cache_events=self.enable_kv_cache_events,
                kv_cache_metrics=self.kv_cache_metrics, kv_cache_metrics_sample=self.kv_cache_metrics_sample),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill, log_stats=self.log_stats,
                async_scheduling=self.async_scheduling, policy=self.scheduling_policy),
            parallel_config=self.create_parallel_config(),
            device_config=DeviceConfig(device=device, num_threads=self.num_threads,
                                       attention_backend=self.attention_backend, enforce_eager=self.enforce_eager),
            kv_transfer_config=KVTransferConfig.parse(self.kv_transfer_config),
            ec_transfer_config=self.create_ec_transfer_config(),
            mm_config=self.create_mm_config(),
            lora_config=self.create_lora_config(),
        )

    def create_lora_config(self) -> LoRAConfig | None:
        """The LoRAConfig when enable_lora (validated), else None (the LoRA knobs must stay at
        their defaults then: a knob that would do nothing is refused)."""
        if not self.enable_lora:
            if (self.max_loras, self.max_lora_rank, self.max_cpu_loras) != (1, 16, None):
                raise InvalidEngineArgsError(
                    "max_loras, max_lora_rank and max_cpu_loras apply only with enable_lora=True "
                    "(--enable-lora).")
            return None
        if self.tensor_parallel_size > 1:
            raise InvalidEngineArgsError(
                f"enable_lora=True with tensor_parallel_size={self.tensor_parallel_size}: LoRA runs on one "
                "tensor-parallel rank only; use tensor_parallel_size=1 (or data parallelism).")
        return LoRAConfig(enable_lora=True, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras)

    def create_parallel_config(self) -> ParallelConfig:
        """The ParallelConfig (validated by _verify)."""
        backend = self.distributed_executor_backend
        if self.tensor_parallel_size > 1 and backend == "uni":
            backend = "mp"  # one process cannot hold several ranks (as vLLM switches)
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                              data_parallel_size=self.data_parallel_size,
                              data_parallel_rank=self.data_parallel_rank,
                              data_parallel_backend=self.data_parallel_backend,
                              distributed_executor_backend=backend,
                              ray_per_worker_cpus=(None if self.ray_per_worker_cpus is None
                                                   else float(self.ray_per_worker_cpus)))

    def create_mm_config(self) -> MultiModalConfig:
        """The resolved MultiModalConfig (validated)."""
        from lm_console.engine.multimodal.config import MultiModalConfig

        mm_config = MultiModalConfig(
            mm_processor_cache_gb=self.mm_processor_cache_gb, mm_hasher_algorithm=self.mm_hasher_algorithm,
            disable_chunked_mm_input=self.disable_chunked_mm_input, encoder_cache_size=self.encoder_cache_size,
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens)
        mm_config.verify()
        return mm_config

    def create_ec_transfer_config(self) -> ECTransferConfig | None:
        """ECTransferConfig from ec_transfer_config (dict or JSON string), or None."""
        if self.ec_transfer_config is None:
            return None
        from lm_console.engine.distributed.ec_transfer.config import ECTransferConfig

        return ECTransferConfig.from_arg(self.ec_transfer_config)

    @property
    def uses_data_parallel_client(self) -> bool:
        """Whether the frontend drives its cores through the DP client: several cores, or one
        core as a Ray actor (data_parallel_backend="ray")."""
        return self.data_parallel_size > 1 or self.data_parallel_backend == "ray"

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
            return is_int(value) or (isinstance(value, float) and math.isfinite(value))

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
                     "log_stats", "multiprocess", "disable_chunked_mm_input", "async_scheduling",
                     "kv_cache_metrics", "kv_cache_prefault"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "it must be True or False")
        if not is_int(self.seed):
            fail("seed", "it must be an integer in the signed 64-bit range")
        if self.quantization not in QUANTIZATION_CHOICES:
            fail("quantization", f"it must be one of {', '.join(map(str, QUANTIZATION_CHOICES))}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            fp8 = isinstance(self.kv_cache_dtype, str) and self.kv_cache_dtype.startswith("fp8")
            fail("kv_cache_dtype", f"it must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}"
                 + ("; there is no fp8 KV cache here: 'int8' is the quantized one" if fp8 else ""))
        if not is_int(self.max_logprobs) or self.max_logprobs < -1:
            fail("max_logprobs", "it must be an integer >= 0, or -1 for no limit")
        if self.liveness_timeout_s is not None and (not is_number(self.liveness_timeout_s)
                                                    or self.liveness_timeout_s <= 0):
            fail("liveness_timeout_s", "it must be a finite number of seconds > 0, or None to never time out")
        if self.scheduling_policy not in ("fcfs", "priority"):
            fail("scheduling_policy", "allowed: 'fcfs' (first come, first served) or 'priority'")
        if not is_number(self.kv_cache_metrics_sample) or not 0.0 < self.kv_cache_metrics_sample <= 1.0:
            fail("kv_cache_metrics_sample", "it must be a number in (0, 1]: the fraction of blocks sampled")
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
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise InvalidEngineArgsError(
                f"attention_backend={self.attention_backend!r} must be one of auto, cpu, torch, triton.")
        if self.attention_backend == "cpu" and self.device == "cuda":
            raise InvalidEngineArgsError(
                "attention_backend='cpu' runs the C kernels on the CPU, not with device='cuda': use 'auto' or 'triton'.")
        if self.zmq_transport not in ("ipc", "tcp"):
            raise InvalidEngineArgsError(f"zmq_transport={self.zmq_transport!r} must be one of ipc, tcp.")
        if self.distributed_executor_backend not in ("uni", "fake", "mp", "ray"):
            raise InvalidEngineArgsError(
                f"distributed_executor_backend={self.distributed_executor_backend!r} is unknown; "
                "allowed: uni, fake, mp, ray.")
        if not is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            fail("tensor_parallel_size", "it must be an integer >= 1")
        if self.tensor_parallel_size > 1 and self.quantization not in (None, "auto", "none"):
            # A .gguf model is dequantized to safetensors, which TP slices; kept-quantized
            # weights (int8 / packed GGUF blocks) have no per-rank slicing yet.
            raise InvalidEngineArgsError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs unquantized safetensors weights; "
                f"quantization={self.quantization!r} runs with tensor_parallel_size=1.")
        if self.tensor_parallel_size > 1 and self.distributed_executor_backend == "fake":
            raise InvalidEngineArgsError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs real workers; "
                "distributed_executor_backend='fake' runs no model.")
        if self.ray_per_worker_cpus is not None:
            if not is_number(self.ray_per_worker_cpus) or self.ray_per_worker_cpus <= 0:
                fail("ray_per_worker_cpus", "it must be a finite number of CPUs > 0 (fractions allowed), "
                     "or None for the default (1 on the CPU, none on CUDA)")
            if self.distributed_executor_backend != "ray":
                raise InvalidEngineArgsError(
                    f"ray_per_worker_cpus={self.ray_per_worker_cpus!r} sizes Ray worker actors; it needs "
                    f"distributed_executor_backend='ray' (got {self.distributed_executor_backend!r}).")
        self._verify_data_parallel()
        KVTransferConfig.parse(self.kv_transfer_config)  # fail in the frontend, before any process starts
        if self.kv_transfer_config is not None:
            _refuse_hybrid_model_with_connector(self.model)
        for name in ("kv_transfer_config", "ec_transfer_config"):
            if self.async_scheduling and getattr(self, name) is not None:
                raise InvalidEngineArgsError(
                    f"async_scheduling=True cannot be combined with {name}: a connector plans each step from "
                    "the previous step's finished output, which async scheduling does not wait for. "
                    "Drop one of the two.")

    def _verify_data_parallel(self) -> None:
        """data_parallel_size / _rank / _backend / _routing (InvalidEngineArgsError)."""
        size, rank = self.data_parallel_size, self.data_parallel_rank
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= 64:
            raise InvalidEngineArgsError(f"data_parallel_size={size!r} is invalid: it must be an integer in [1, 64].")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
            raise InvalidEngineArgsError(
                f"data_parallel_rank={rank!r} is invalid: it must be in [0, data_parallel_size={size}) "
                "(the DP client sets it for each core; leave it at 0).")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise InvalidEngineArgsError(
                f"data_parallel_backend={self.data_parallel_backend!r} is unknown; allowed: mp, ray.")
        if self.data_parallel_routing not in ("least_loaded", "prefix"):
            raise InvalidEngineArgsError(
                f"data_parallel_routing={self.data_parallel_routing!r} is unknown; allowed: least_loaded, prefix.")
        if self.data_parallel_routing == "prefix" and not self.enable_prefix_caching:
            raise InvalidEngineArgsError(
                "data_parallel_routing='prefix' needs enable_prefix_caching=True (it follows each core's prefix cache).")
        if self.uses_data_parallel_client:  # ray: even one core runs as an actor
            if not self.multiprocess:
                raise InvalidEngineArgsError(
                    f"data_parallel_size={size} with data_parallel_backend={self.data_parallel_backend!r} needs "
                    "multiprocess=True: each engine core runs in its own process.")
            if self.kv_events_endpoint is not None:
                raise InvalidEngineArgsError(
                    f"kv_events_endpoint={self.kv_events_endpoint!r} cannot be shared by {size} engine cores: leave "
                    "it unset (each core publishes on its own private endpoint, and its events reach the frontend "
                    "tagged with its data_parallel_rank).")

    def create_frontend_config(self, info: EngineCoreReadyInfo) -> EngineConfig:
        """The frontend's EngineConfig: the core's resolved configs from its ready handshake
        (no torch, no model files read), with this process's own multimodal settings."""
        self._verify()
        return EngineConfig(
            model_config=info.model_config, cache_config=info.cache_config,
            scheduler_config=info.scheduler_config, parallel_config=self.create_parallel_config(),
            device_config=info.device_config, kv_transfer_config=KVTransferConfig.parse(self.kv_transfer_config),
            ec_transfer_config=self.create_ec_transfer_config(), mm_config=self.create_mm_config(),
            lora_config=self.create_lora_config(),
        )


QUANTIZATION_CHOICES = (None, "auto", "none", "gguf", "int8")


def resolve_quantization(requested: str | None, model_dir: str, dtype: str, device: str,
                         executor_backend: str = "uni") -> str | None:
    """The quantization a model runs with: "gguf", "int8" or None (dense).

    Auto (None / "auto") keeps a GGUF model's own quantized weights in bf16 on the CPU: the int8
    kernels measured faster than dense bf16 at every batch size, within 1% of the file's
    perplexity (docs/quantized-cpu.md). Everything else stays dense, float32 too (the
    exactness tests compare HF op for op), as does auto where the C kernels are off
    (LMC_CPU_KERNELS=0), no C compiler is found or the CPU lacks AVX512-VNNI (the kernels' portable
    path is slower than dense bf16 there); LMC_QUANT_AUTO=0 makes auto dense. Explicit
    values are checked, never ignored.
    """
    from lm_console.engine.models.embedded import gguf_source

    if requested == "none" or executor_backend == "fake":
        return None
    source = gguf_source(model_dir)
    if requested in (None, "auto"):
        if source is None or dtype != "bfloat16" or device != "cpu":
            return None
        if (envs.LMC_QUANT_AUTO.is_off("none", "dense")
                or envs.LMC_CPU_KERNELS.is_off()
                or not (envs.CC.get() or shutil.which("cc") or shutil.which("gcc"))
                or not cpu_has_int8_dot()):
            return None
        return "gguf"  # the loader refuses it clearly if the kernels cannot be built
    if device != "cpu":
        raise InvalidEngineArgsError(f"quantization={requested!r} runs on the CPU only (device={device!r}).")
    if requested == "gguf" and source is None:
        raise InvalidEngineArgsError(
            f"quantization='gguf' needs a model converted from a GGUF file; {model_dir!r} is not one.")
    return requested


def _verify_tensor_parallel(model: ModelConfig, tp_size: int) -> None:
    """Tensor parallelism splits the query and KV heads: both must divide by tp_size."""
    for what, count in (("num_attention_heads", model.num_attention_heads), ("num_key_value_heads", model.num_kv_heads)):
        if count % tp_size:
            raise InvalidEngineArgsError(
                f"tensor_parallel_size={tp_size} does not divide the model's {what}={count}: each rank "
                f"holds an equal share of the heads; use a tensor_parallel_size that divides "
                f"{model.num_attention_heads} and {model.num_kv_heads}.")


def attention_kinds(model: str | None) -> set[str] | None:
    """The distinct attention kinds ("full_attention", "sliding_attention") of the model's
    layers, read from its config.json or GGUF metadata without loading weights; None when the
    model is a known name (the embedded models are full-attention Llamas) or not found (its own
    error comes later, from the engine core)."""
    import json
    from pathlib import Path

    if model is None:
        return None
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        return set(_gguf_attention_kinds(str(path.resolve()), stat.st_size, stat.st_mtime_ns))
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return None
    else:
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        return None
    types = text.get("layer_types")
    if str(text.get("model_type", "")).startswith("gemma3") or config.get("model_type") == "gemma3":
        pattern, layers = text.get("sliding_window_pattern") or 6, text.get("num_hidden_layers")
        if not types and isinstance(pattern, int) and pattern > 0 and isinstance(layers, int):
            # gemma3's default: every 6th layer global (lm_console/engine/models/gemma3.py)
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(min(layers, 1 << 16))]
    elif text.get("sliding_window") is None or text.get("use_sliding_window") is False:
        return {"full_attention"}  # llama-family layers ignore layer_types without a window
    if not isinstance(types, list) or not types:
        return None
    return {str(t) for t in types}


@functools.lru_cache(maxsize=8)
def _gguf_attention_kinds(path: str, size: int, mtime_ns: int) -> frozenset[str]:
    """Memoized by (path, size, mtime): _verify runs in the frontend and again in the core."""
    from lm_console.engine.models.gguf_check import attention_kinds_of_gguf

    return frozenset(attention_kinds_of_gguf(path))  # the layout scan: an invalid file is refused here, early


def _refuse_hybrid_model_with_connector(model: str | None) -> None:
    """A KV connector moves one KV cache group's blocks; a hybrid model (full and sliding-window
    layers, e.g. Gemma3) has two, which the worker would refuse only after the processes start."""
    kinds = attention_kinds(model)
    if kinds is not None and len(kinds) > 1:
        raise InvalidEngineArgsError(
            f"kv_transfer_config cannot be used with {model!r}: its layers mix {' and '.join(sorted(kinds))} "
            "(a hybrid KV cache of several groups), and KV connectors move a single group's blocks. "
            "Drop kv_transfer_config (--kv-offload, --kv-transfer-config) for this model, or use a model "
            "whose layers all share one attention kind.")


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
