"""EngineArgs: the user-facing knobs, validated and resolved into an EngineConfig.

EngineArgs has no field of its own: each is a knob declared once, on its config class (knob() in
lm_console/engine/config/fields.py), and @engine_args_from gives EngineArgs a field of the same
name, type and default for each knob of ENGINE_ARG_SOURCES (docs/development.md, "Config
knobs"). create_engine_config runs where the engine core runs (it resolves the model and the
device); the frontend rebuilds its config from the core's ready handshake (create_frontend_config).
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from lm_console.engine import envs
from lm_console.engine.config.cache import (
    KV_CACHE_DTYPE_CHOICES,
    CacheConfig,
    KVCacheDtype,
    resolve_kv_cache_dtype,
)
from lm_console.engine.config.device import DeviceConfig
from lm_console.engine.config.engine_config import EngineConfig
from lm_console.engine.config.fields import UNSET, declarations, verify_values
from lm_console.engine.config.knobs import ENGINE_ARG_SOURCES, engine_arg_declarations
from lm_console.engine.config.kv_transfer import KVTransferConfig
from lm_console.engine.config.lora import LoRAConfig
from lm_console.engine.config.model import ModelConfig, Quantization
from lm_console.engine.config.multimodal import MultiModalConfig
from lm_console.engine.config.observability import ObservabilityConfig
from lm_console.engine.config.parallel import ParallelConfig
from lm_console.engine.config.scheduler import SchedulerConfig
from lm_console.engine.config.speculative import SpeculativeConfig
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.platform import cpu_has_int8_dot

if TYPE_CHECKING:
    from lm_console.engine.config.ec_transfer import ECTransferConfig
    from lm_console.engine.protocol import EngineCoreReadyInfo

__all__ = ["ENGINE_ARG_SOURCES", "KV_CACHE_DTYPE_CHOICES", "QUANTIZATION_CHOICES", "EngineArgs",
           "engine_arg_declarations", "resolve_quantization"]

C = TypeVar("C")


def engine_args_from(cls: type) -> type:
    """Make cls a dataclass with one field per knob of ENGINE_ARG_SOURCES (its type and default)."""
    annotations: dict[str, Any] = {}
    for name, decl in engine_arg_declarations().items():
        annotations[name] = decl.arg_type
        if decl.default_factory is not dataclasses.MISSING and decl.spec.arg_default is UNSET:
            setattr(cls, name, dataclasses.field(default_factory=decl.default_factory))
        else:
            setattr(cls, name, decl.default_value())
    cls.__annotations__ = annotations
    return dataclass(cls)


@engine_args_from
class EngineArgs:
    """Every engine argument that `LLM(model, **engine_args)` and the `lmc` flags accept.

    Its fields are the knobs of ENGINE_ARG_SOURCES (engine_arg_declarations() lists them with
    their config class; docs/configuration.md renders them).
    """

    if TYPE_CHECKING:  # the fields come from the declarations; mypy sees them as Any
        def __init__(self, **kwargs: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...

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
            max_model_len=self.max_model_len, max_logprobs=self.max_logprobs,
            # Tensor parallelism slices dense weights only: auto then stays dense.
            quantization=cast(Quantization, resolve_quantization("none" if self.tensor_parallel_size > 1 else self.quantization,
                                              model_dir, dtype, device,
                                              self.distributed_executor_backend)))
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
            cache_config=self.config_of(CacheConfig, kv_cache_dtype=cast(KVCacheDtype, kv_cache_dtype)),
            scheduler_config=self.config_of(SchedulerConfig, max_num_batched_tokens=max_num_batched_tokens),
            parallel_config=self.create_parallel_config(),
            device_config=self.config_of(DeviceConfig, device=device),
            kv_transfer_config=KVTransferConfig.parse(self.kv_transfer_config),
            ec_transfer_config=self.create_ec_transfer_config(),
            mm_config=self.create_mm_config(),
            observability_config=self.create_observability_config(),
            speculative_config=self.create_speculative_config(device),
            lora_config=self.create_lora_config(),
        )

    def create_speculative_config(self, device: str) -> SpeculativeConfig | None:
        """The SpeculativeConfig (None: off), its "auto" batch-size limit resolved for `device`."""
        config = SpeculativeConfig.parse(self.speculative_config)
        return None if config is None else config.for_device(device)

    def create_observability_config(self) -> ObservabilityConfig:
        """The ObservabilityConfig (validated there: URL shape, OpenTelemetry installed)."""
        return self.config_of(ObservabilityConfig)

    def create_lora_config(self) -> LoRAConfig | None:
        """The LoRAConfig when enable_lora, else None (LoRA off; LoRAConfig.verify_relations
        refuses the other LoRA knobs without enable_lora)."""
        config = self.config_of(LoRAConfig)
        return config if config.enable_lora else None

    def create_parallel_config(self) -> ParallelConfig:
        """The ParallelConfig (checked again by its own __post_init__)."""
        backend = self.distributed_executor_backend
        if self.tensor_parallel_size > 1 and backend == "uni":
            backend = "mp"  # one process cannot hold several ranks (as vLLM switches)
        cpus = None if self.ray_per_worker_cpus is None else float(self.ray_per_worker_cpus)
        return self.config_of(ParallelConfig, distributed_executor_backend=backend, ray_per_worker_cpus=cpus)

    def config_of(self, cls: type[C], **resolved: Any) -> C:
        """cls made from these arguments' values of its knobs, with `resolved` (field -> value)
        in place of those the engine resolved (device "auto" -> "cpu", ...)."""
        values = {d.field: getattr(self, d.arg) for d in declarations(cls) if d.spec.user}
        return cls(**{**values, **resolved})

    def create_mm_config(self) -> MultiModalConfig:
        """The resolved MultiModalConfig (validated)."""
        mm_config = self.config_of(MultiModalConfig)
        mm_config.verify()
        return mm_config

    def create_ec_transfer_config(self) -> ECTransferConfig | None:
        """ECTransferConfig from ec_transfer_config (dict or JSON string), or None."""
        if self.ec_transfer_config is None:
            return None
        from lm_console.engine.config.ec_transfer import ECTransferConfig

        return ECTransferConfig.from_arg(self.ec_transfer_config)

    @property
    def uses_data_parallel_client(self) -> bool:
        """Whether the frontend drives its cores through the DP client: several cores, or one
        core as a Ray actor (data_parallel_backend="ray")."""
        return self.data_parallel_size > 1 or self.data_parallel_backend == "ray"

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> EngineArgs:
        """Build EngineArgs, naming unknown arguments in the error."""
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidEngineArgsError(
                f"Unknown engine argument(s) {unknown}; allowed: {sorted(names - {'model'})}."
            )
        return cls(model=model, **kwargs)

    def _verify(self) -> None:
        """Check every knob against its declaration, then the rules across config classes
        (InvalidEngineArgsError naming the argument and what it accepts)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        for cls in ENGINE_ARG_SOURCES:
            verify_values(cls, values, by_arg=True)
        self._verify_across()

    def _verify_across(self) -> None:
        """The rules that tie knobs of several config classes together."""
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
        if self.data_parallel_routing == "prefix" and not self.enable_prefix_caching:
            raise InvalidEngineArgsError(
                "data_parallel_routing='prefix' needs enable_prefix_caching=True (it follows each core's prefix cache).")
        if self.uses_data_parallel_client:  # ray: even one core runs as an actor
            if not self.multiprocess:
                raise InvalidEngineArgsError(
                    f"data_parallel_size={self.data_parallel_size} with data_parallel_backend="
                    f"{self.data_parallel_backend!r} needs multiprocess=True: each engine core runs in its own process.")
            if self.kv_events_endpoint is not None:
                raise InvalidEngineArgsError(
                    f"kv_events_endpoint={self.kv_events_endpoint!r} cannot be shared by {self.data_parallel_size} "
                    "engine cores: leave it unset (each core publishes on its own private endpoint, and its events "
                    "reach the frontend tagged with its data_parallel_rank).")
        if self.kv_transfer_config is not None:
            _refuse_hybrid_model_with_connector(self.model)
        for name in ("kv_transfer_config", "ec_transfer_config"):
            if self.async_scheduling and getattr(self, name) is not None:
                raise InvalidEngineArgsError(
                    f"async_scheduling=True cannot be combined with {name}: a connector plans each step from "
                    "the previous step's finished output, which async scheduling does not wait for. "
                    "Drop one of the two.")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise InvalidEngineArgsError(
                f"enable_lora=True with tensor_parallel_size={self.tensor_parallel_size}: LoRA runs on one "
                "tensor-parallel rank only; use tensor_parallel_size=1 (or data parallelism).")
        self._verify_speculative()

    def _verify_speculative(self) -> None:
        """speculative_config, and what it cannot combine with (InvalidEngineArgsError)."""
        if SpeculativeConfig.parse(self.speculative_config) is None:
            return
        for name, on in (("async_scheduling", self.async_scheduling),
                         ("tensor_parallel_size > 1", self.tensor_parallel_size > 1),
                         ("kv_transfer_config", self.kv_transfer_config is not None),
                         ("ec_transfer_config", self.ec_transfer_config is not None)):
            if on:
                raise InvalidEngineArgsError(
                    f"speculative_config cannot be combined with {name}: the proposals are made from each "
                    "step's accepted tokens, which that mode does not wait for or share. Drop one of the two.")

    def create_frontend_config(self, info: EngineCoreReadyInfo) -> EngineConfig:
        """The frontend's EngineConfig: the core's resolved configs from its ready handshake
        (no torch, no model files read), with this process's own multimodal settings."""
        self._verify()
        return EngineConfig(
            model_config=info.model_config, cache_config=info.cache_config,
            scheduler_config=info.scheduler_config, parallel_config=self.create_parallel_config(),
            device_config=info.device_config, kv_transfer_config=KVTransferConfig.parse(self.kv_transfer_config),
            ec_transfer_config=self.create_ec_transfer_config(), mm_config=self.create_mm_config(),
            observability_config=self.create_observability_config(),
            lora_config=self.create_lora_config(),
        )


QUANTIZATION_CHOICES: tuple[str | None, ...] = Quantization.__args__  # type: ignore[attr-defined]


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

