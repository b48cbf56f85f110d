"""Attention backend selection: the C kernels' backend on CPU, Triton on CUDA, or as the engine args force.

"triton" on a CPU device runs the kernels under Triton's interpreter (slow; for tests). Triton
fixes interpretation per function when it is decorated, its own library (tl.sum, tl.zeros...)
included, i.e. when triton itself is first imported: so TRITON_INTERPRET=1 is set here if triton
is not imported yet, and an already-imported compiled triton is reported as an error.
"""

from __future__ import annotations

import importlib
import os
import sys
import torch

from lm_console.engine.attention.backend import AttentionBackend
from lm_console.engine.errors import InvalidEngineArgsError

ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The concrete backend for `name` on `device`: "auto" is triton on CUDA, cpu elsewhere."""
    if name not in ATTENTION_BACKENDS:
        raise InvalidEngineArgsError(
            f"attention_backend={name!r} must be one of {', '.join(ATTENTION_BACKENDS)}.")
    if name == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    if name == "cpu" and device.type != "cpu":
        raise InvalidEngineArgsError(
            f"attention_backend='cpu' runs the C kernels on the CPU, not on {device}: use 'auto' or 'triton'.")
    return name


def load_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend instance for `name` on `device` (its module imported on demand)."""
    backend = resolve_attention_backend(name, device)
    if backend in ("cpu", "torch"):
        from lm_console.engine.attention.torch_backend import CpuAttentionBackend, TorchAttentionBackend

        return CpuAttentionBackend() if backend == "cpu" else TorchAttentionBackend()
    if device.type not in ("cpu", "cuda"):
        raise InvalidEngineArgsError(f"attention_backend='triton' needs CUDA or CPU, not {device}.")
    if device.type == "cpu" and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module("lm_console.engine.attention.triton_backend")
        backend_cls: type[AttentionBackend] = module.TritonAttentionBackend
    except ImportError as error:
        raise InvalidEngineArgsError(
            f"attention_backend='triton' needs the triton package ({error}).") from error
    import triton.language as tl

    from lm_console.kernels.common import is_interpreted
    from lm_console.kernels.paged_attention import _paged_attention_kernel

    interpreted = is_interpreted(tl.zeros) and is_interpreted(_paged_attention_kernel)
    if device.type == "cpu" and not interpreted:
        raise InvalidEngineArgsError(
            "attention_backend='triton' on CPU runs Triton's interpreter, but triton was imported "
            "before TRITON_INTERPRET=1 was set: set it in the environment before starting.")
    if device.type == "cuda" and is_interpreted(_paged_attention_kernel):
        raise InvalidEngineArgsError(
            "TRITON_INTERPRET=1 is set, so the Triton kernels cannot run on CUDA: unset it.")
    return backend_cls()
