"""DeviceConfig: the device, threads and attention backend the model runs with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceConfig:
    """Where and how the model runs: the device by name (engine.platform.torch_device gives the torch one)."""

    device: str = "cpu"  # cpu | cuda
    num_threads: int | None = None  # torch intra-op threads on CPU (None: all cores)
    attention_backend: str = "auto"  # auto | cpu | torch | triton (lm_console/engine/attention/selector.py)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
