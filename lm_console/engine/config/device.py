"""DeviceConfig: the device, threads and attention backend the model runs with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lm_console.engine.config.fields import DeclaredConfig, knob

Device = Literal["auto", "cpu", "cuda"]
AttentionBackendName = Literal["auto", "cpu", "torch", "triton"]


@dataclass(frozen=True)
class DeviceConfig(DeclaredConfig):
    """Where and how the model runs: the device by name (engine.platform.torch_device gives the torch one).

    EngineArgs resolves device "auto" (cuda where one is found, else cpu) before the config is made.
    """

    device: Device = knob("auto", cli=None, help="auto (cuda where one is found, else cpu) | cpu | cuda.")
    num_threads: int | None = knob(
        None, ge=1, help="torch threads on CPU (default: all cores; tui/chat/events: all but one, which the "
                         "console uses).")
    attention_backend: AttentionBackendName = knob(
        "auto", cli=None, help="auto (triton on CUDA, cpu on CPU) | cpu (C kernels) | torch | triton "
                               "(lm_console/engine/attention/selector.py).")
    enforce_eager: bool = knob(False, cli=None, help="CUDA: no CUDA graphs for decode steps.")

    @classmethod
    def verify_relations(cls, values: Mapping[str, Any]) -> None:
        """The C-kernel backend runs on the CPU only."""
        from lm_console.engine.errors import InvalidEngineArgsError

        if values.get("attention_backend") == "cpu" and values.get("device") == "cuda":
            raise InvalidEngineArgsError(
                "attention_backend='cpu' runs the C kernels on the CPU, not with device='cuda': use 'auto' or 'triton'.")
