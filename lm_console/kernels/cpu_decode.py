"""The whole-stack decode driver (lm_console/kernels/cpu/decode_stack.c) via ctypes: one call per step.

A batch-1 decode step of the embedded model runs ~15 small kernels per layer; called one by one
from Python each pays a torch dispatch or a ctypes call (argument conversion, checks, a fresh
output tensor), about as much again as the kernel's own work at one row. The driver runs the
same kernels in the same order from C, over persistent buffers: the quantized path's hidden
states are bit-identical to the layer-by-layer forward's.

The driver takes the kernels as function pointers read from their loaded libraries
(quant_gemm.c, fused_ops.c, paged_attention.c, cache_write.c), so it always runs the kernels
the rest of the engine runs and compiles none of them twice. Its arrays' layouts (enums in
decode_stack.c) are mirrored here.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import Tensor

from lm_console.kernels import cpu_attention, cpu_ops, cpu_quant, lora_ops
from lm_console.kernels.cpu_build import CpuKernelBuildError, load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "decode_stack.c"

# decode_stack.c's enums, in order.
KERNELS = ("quantize_act", "quant_gemm", "rms_norm_bf16", "add_rms_norm_bf16", "rms_norm_heads_bf16",
           "rotary_neox_bf16", "silu_and_mul_bf16", "paged_decode_attention_bf16", "reshape_and_cache_rows", "lora_add_bf16")
GLOBALS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "block_size", "qk_norm",
           "max_rows", "max_position", "num_slots", "kv_int8", "max_loras")
LINEAR = ("fmt", "n", "k", "kp", "w", "scales", "offsets", "bias", "lora_a", "lora_b_t", "lora_rank")
LAYER_TAIL = ("in_norm", "post_norm", "q_norm", "k_norm", "k_cache", "v_cache", "block_stride", "window")
LAYER_FIELDS = 4 * len(LINEAR) + len(LAYER_TAIL)
STEP = ("rows", "embeds", "out", "positions", "slots", "block_table", "block_table_stride", "seq_lens",
        "blocks_per_row", "lora_slots", "lora_scalings")
BUFFERS = ("res_a", "res_b", "normed", "qkv", "attn", "gate_up", "act", "xq", "xd", "xs", "cos", "sin")
FMT_DENSE_BF16 = 16

_P, _F = ctypes.c_void_p, ctypes.c_float


@functools.cache
def load(scalar: bool = False) -> ctypes.CDLL | None:
    """The driver library (scalar=True: no AVX512-BF16 dense GEMV), or None when unavailable."""
    library = load_library(SOURCE, "CPU decode-stack driver", ("LMC_SCALAR",) if scalar else ())
    if library is None:
        return None
    library.decode_stack_run.argtypes = [_P, _P, _P, _P, _F, _F, _F, _P, _P, _P, _P]
    library.decode_stack_run.restype = ctypes.c_int
    library.decode_stack_has_bf16.argtypes, library.decode_stack_has_bf16.restype = [], ctypes.c_int
    library.decode_stack_dense_linear.argtypes = [_P, _P, ctypes.c_int64, ctypes.c_int64, _P, ctypes.c_int64]
    library.decode_stack_dense_linear.restype = None
    return library


def dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, scalar: bool = False) -> Tensor:
    """x [M, K] bf16 @ weight [N, K] bf16 ^T (+ bias float32 [N]) -> bf16 [M, N] with the driver's
    own dense GEMV (the one its FMT_DENSE_BF16 linears run; exposed for tests)."""
    library = load(scalar)
    if library is None:
        raise CpuKernelBuildError("the CPU decode-stack driver is not available")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype != torch.bfloat16 or t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 2-D bf16 tensor, got {t.dtype} {tuple(t.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, weight {weight.shape[1]}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.shape[0],)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 [{weight.shape[0]}]")
    n, k = weight.shape
    lin = (ctypes.c_int64 * len(LINEAR))(FMT_DENSE_BF16, n, k, k, weight.data_ptr(), 0, 0,
                                          bias.data_ptr() if bias is not None else 0, 0, 0, 0)
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    library.decode_stack_dense_linear(lin, x.data_ptr(), k, x.shape[0], out.data_ptr(), n)
    return out


_I64, _I = ctypes.c_int64, ctypes.c_int
# The C signatures decode_stack.c's typedefs were written against: where a kernel library
# declares another (an edited kernel), the driver stays off rather than call it wrongly.
EXPECTED_ARGTYPES = {
    "quantize_act": [_P, _I64, _I, _I64, _I64, _I64, _I, _P, _P, _P],
    "quant_gemm": [_I, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I],
    "rms_norm_bf16": [_P, _I64, _P, _I64, _P, _I64, _I64, _F],
    "add_rms_norm_bf16": [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _F],
    "rms_norm_heads_bf16": [_P, _I64, _P, _I64, _I64, _I64, _F],
    "rotary_neox_bf16": [_P, _I64, _P, _P, _I64, _I64, _I64],
    "silu_and_mul_bf16": [_P, _I64, _P, _I64, _I64, _I64],
    "paged_decode_attention_bf16": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _P, _I64, _P,
                                    _I, _I, _I, _I, _I, _F, _I, _F, _I64, _I64],
    "reshape_and_cache_rows": [_P, _I64, _P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64],
    "lora_add_bf16": [_P] * 6 + [_I64] * 6,
}
# Kernels the driver runs without: with no LoRA library its table holds NULL there, and the
# driver refuses the steps with adapters (the layer path serves them, with its own fallback).
OPTIONAL = frozenset({"lora_add_bf16"})
# The int8 cache's kernels take the same arguments (caches as bytes; the writer's last one is the
# head size): kernel_table(int8_cache=True) puts them in the bf16 ones' places.
INT8_CACHE_KERNELS = {"paged_decode_attention_bf16": "paged_decode_attention_int8",
                      "reshape_and_cache_rows": "reshape_and_cache_int8_rows"}


@functools.cache
def kernel_table(int8_cache: bool = False, lora: bool = False) -> ctypes.Array | None:
    """The driver's function-pointer table (KERNELS order; int8_cache: the int8 cache's attention
    and writer; lora: the LoRA kernel too, else NULL in its place, and nothing compiled for it),
    or None if a library is missing or declares a kernel with another signature than the driver
    calls it with."""
    libraries = {"quant": cpu_quant.load(), "ops": cpu_ops.load(), "attention": cpu_attention.load(),
                 "lora": lora_ops.load() if lora else None}
    if any(lib is None for name, lib in libraries.items() if name != "lora"):
        return None
    owners = {"quantize_act": "quant", "quant_gemm": "quant", "paged_decode_attention_bf16": "attention",
              "reshape_and_cache_rows": "attention", "lora_add_bf16": "lora"}
    table = (ctypes.c_void_p * len(KERNELS))()
    for i, name in enumerate(KERNELS):
        if name in OPTIONAL and libraries[owners[name]] is None:
            continue  # NULL: the driver refuses what needs it
        symbol = INT8_CACHE_KERNELS.get(name, name) if int8_cache else name
        fn = getattr(libraries[owners.get(name, "ops")], symbol, None)
        if fn is None or list(fn.argtypes or ()) != EXPECTED_ARGTYPES[name]:
            logger.warning("decode-stack driver off: %s is missing or its signature changed", symbol)
            return None
        table[i] = ctypes.cast(fn, ctypes.c_void_p).value
    return table
