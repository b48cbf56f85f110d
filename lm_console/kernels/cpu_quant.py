"""Quantized-weight linears for CPU inference: C kernels (lm_console/kernels/cpu/quant_gemm.c) via ctypes.

A `QuantWeight` holds one linear's weights in one of our packed formats, all in the tiled
layout of quant_gemm.c (rows in tiles of 16, interleaved four elements at a time, so that a
512-bit vector holds 16 rows; N padded to a multiple of 16, K to a multiple of 64):

- "b8": unsigned 8-bit values with an fp16 scale and offset per block of 32 (GGUF Q8_0, and
  the formats requantized to 8 bits at load: Q6_K and others)
- "b4": 4-bit values, two blocks' nibbles in each byte, fp16 scale and offset per block
  (GGUF Q4_0, Q4_1, Q4_K)
- "c8": int8 per output channel (one float32 scale per row), quantization="int8"
  (activations per block of 32 as for the others: per token cost +2.9% perplexity on SmolLM2)

`quant_linear` quantizes the activations to int8 per block of 32 (as llama.cpp's Q8_0
activations; per token measured +2.9% perplexity on SmolLM2, per block +0.9%) and runs the
int8 GEMM, which reads every weight row once
for the whole batch (prefill too: 8 tokens share each tile's vectors from L1). Above
`dense_rows()` rows (never by default; LMC_QUANT_DENSE_ROWS) the block formats are dequantized to a
scratch matrix in the activations' dtype and multiplied by torch (oneDNN) instead.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lm_console.engine import envs
from lm_console.engine.platform import cpu_flags
from lm_console.kernels import cpu_ops
from lm_console.kernels.cpu_build import CpuKernelBuildError, load_library

SOURCE = Path(__file__).parent / "cpu" / "quant_gemm.c"
FORMATS = {"b8": 0, "b4": 1, "c8": 2}
BLOCK = 32
PAIR = 64  # K is padded to a whole number of block pairs (one 512-bit vector of int8)
TILE = 16  # rows a tile (the int32 lanes of a 512-bit vector); N is padded to a multiple

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "quant_gemm_has_vnni": ([], _I),
    "quant_gemm_set_amx": ([_I], _I),
    "quant_gemm_amx_calls": ([], _I64),
    "quantize_act": ([_P, _I64, _I, _I64, _I64, _I64, _I, _P, _P, _P], None),
    "quant_gemm": ([_I, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I], None),
    "quant_dequantize": ([_I, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I], None),
    "quant_rows": ([_I, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I], None),
    "quant_linear_act": ([_I, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64, _I, _P, _P, _P, _P, _I64, _I],
                         None),
}


@functools.cache
def load(scalar: bool = False) -> ctypes.CDLL | None:
    """The compiled library (scalar=True: the portable path only), or None when unavailable."""
    library = load_library(SOURCE, "CPU quantized GEMM kernels", ("LMC_SCALAR",) if scalar else ())
    if library is None:
        return None
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(library, name)
        fn.argtypes, fn.restype = argtypes, restype
    library.quant_gemm_set_amx(int(not envs.LMC_QUANT_AMX.is_off()))
    return library


def set_amx(on: bool) -> bool:
    """Turn the GEMM's AMX path on or off (tests compare the two); whether it is on now."""
    library = load()
    return library is not None and bool(library.quant_gemm_set_amx(int(on)))


def amx_calls() -> int:
    """How many GEMM calls in this process took the AMX path (0 where it never does)."""
    library = load()
    return 0 if library is None else int(library.quant_gemm_amx_calls())


def _library(scalar: bool = False) -> ctypes.CDLL:
    library = load(scalar)
    if library is None:
        raise CpuKernelBuildError("the CPU quantized GEMM kernels are not available (no C "
                                  "compiler, the build failed, or LMC_CPU_KERNELS=0)")
    return library


def has_vnni() -> bool:
    """Whether the compiled kernels use AVX512-VNNI (else the portable path)."""
    library = load()
    return library is not None and bool(library.quant_gemm_has_vnni())


def padded(k: int) -> int:
    """K rounded up to a whole number of block pairs."""
    return -(-k // PAIR) * PAIR


def padded_rows(n: int) -> int:
    """N rounded up to a whole number of tiles."""
    return -(-n // TILE) * TILE


def _cpu_has_amx() -> bool:
    """Whether the CPU has AMX bf16 tiles, where oneDNN's bf16 matmuls run several times faster
    than AVX512 dot products."""
    return "amx_bf16" in cpu_flags()


# Rows above which block-format linears dequantize to the activation dtype and multiply with
# torch (LMC_QUANT_DENSE_ROWS; default never). Measured on a Zen 4 core (benchmarks/quant_gemm.py,
# SmolLM2's linears): the tiled int8 kernel runs 410-520 GOP/s from 32 rows up, dequantize +
# oneDNN bf16 matmul 300-440. On a CPU with AMX oneDNN's bf16 tiles may be faster on
# prefill-sized batches, but the two paths round differently (int8 activations against bf16
# ones), so a switch on the row count makes a token's logits depend on the batch it lands in:
# measured on a Sapphire Rapids VM with the switch at 16 rows, bf16 greedy output stayed the same
# across a prefix-cache hit for only 13 of 20 prompts, and speculative verification steps diverged
# from plain decoding. One path at every batch size keeps outputs batch-invariant.
DENSE_ROWS = envs.LMC_QUANT_DENSE_ROWS.as_int() if envs.LMC_QUANT_DENSE_ROWS.is_set() else 1 << 40


def dense_rows() -> int:
    """The current DENSE_ROWS."""
    return DENSE_ROWS


@dataclass(slots=True)
class QuantWeight:
    """One linear's packed quantized weights [out_features, in_features] (layouts: module doc)."""

    fmt: str  # b8 | b4 | c8
    out_features: int
    in_features: int
    qweight: Tensor  # uint8 [Np / 16, Kp * 16] (b8, c8) or [Np / 16, Kp * 8] (b4), tiled
    scales: Tensor  # float16 [Np / 16, Kp / 32 * 16] (b8, b4), tiled; float32 [Np] (c8)
    offsets: Tensor | None  # float16 as scales (b8, b4); None for c8
    source: str  # the format it came from (e.g. "Q4_1", "int8"), for reports
    # quant_linear_act's leading arguments (format, sizes, pointers), taken on first use: a
    # decode step calls the kernel ~120 times, where each Python-side microsecond counts
    kernel_args: tuple[int, ...] | None = field(default=None, repr=False, compare=False)

    @property
    def padded_in(self) -> int:
        return padded(self.in_features)

    @property
    def padded_out(self) -> int:
        return padded_rows(self.out_features)

    def nbytes(self) -> int:
        """Resident bytes of the packed weights and their scales."""
        total = self.qweight.nbytes + self.scales.nbytes
        return total + (self.offsets.nbytes if self.offsets is not None else 0)


def _tile_values(q: np.ndarray, fmt: str) -> np.ndarray:
    """Unsigned values q [Np, Kp] (row-major) -> the tiled bytes [Np / 16, ...] of quant_gemm.c."""
    n, kp = q.shape
    tiles = q.reshape(n // TILE, TILE, kp // 4, 4)  # rows, 4-element chunks
    if fmt == "b4":  # chunk c of block 2p low, of block 2p + 1 high
        pairs = tiles.reshape(n // TILE, TILE, kp // PAIR, 2, 8, 4)
        tiles = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n // TILE, TILE, kp // 8, 4)
    return np.ascontiguousarray(tiles.transpose(0, 2, 1, 3)).reshape(n // TILE, -1)


def _tile_scales(v: np.ndarray) -> np.ndarray:
    """Per-block values [Np, nb] -> [Np / 16, nb * 16] (block-major within a tile)."""
    n, nb = v.shape
    return np.ascontiguousarray(v.reshape(n // TILE, TILE, nb).transpose(0, 2, 1)).reshape(n // TILE, -1)


def pack_blocks(fmt: str, q: np.ndarray, d: np.ndarray, m: np.ndarray, source: str) -> QuantWeight:
    """A b8/b4 QuantWeight from unsigned values q [N, K] (0..255 or 0..15) and per-block float
    scales d and offsets m [N, ceil(K / 32)] (w = d * q + m); K is zero-padded to Kp, N to whole
    tiles of 16 (zero rows)."""
    if fmt not in ("b8", "b4"):
        raise ValueError(f"pack_blocks packs b8 or b4, not {fmt!r}")
    n, k = q.shape
    kp, np_ = padded(k), padded_rows(n)
    nb = kp // BLOCK
    qp = np.zeros((np_, kp), dtype=np.uint8)
    qp[:n, :k] = q
    dp = np.zeros((np_, nb), dtype=np.float16)
    mp = np.zeros((np_, nb), dtype=np.float16)
    dp[:n, : d.shape[1]] = d
    mp[:n, : m.shape[1]] = m
    return QuantWeight(fmt, n, k, torch.from_numpy(_tile_values(qp, fmt)),
                       torch.from_numpy(_tile_scales(dp)), torch.from_numpy(_tile_scales(mp)), source)


def quantize_int8_per_channel(weight: Tensor) -> QuantWeight:
    """Symmetric int8 per output channel of a dense weight [N, K] (any float dtype)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int16) + 128
    n, k = w.shape
    qp = np.full((padded_rows(n), padded(k)), 128, dtype=np.uint8)
    qp[:n, :k] = q.to(torch.uint8).numpy()
    scales = torch.zeros(padded_rows(n), dtype=torch.float32)
    scales[:n] = scale
    return QuantWeight("c8", n, k, torch.from_numpy(_tile_values(qp, "c8")), scales, None, "int8")


def unpack_rows(qw: QuantWeight, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows `rows` (int64 [R]) of the packed weights as (q uint8 [R, Kp] unsigned values,
    d float32 [R, Kp / 32], m float32 [R, Kp / 32]) with w = d * q + m per block of 32."""
    kp, nb = qw.padded_in, qw.padded_in // BLOCK
    tile, lane = rows // TILE, rows % TILE
    tiles = qw.qweight.shape[0]
    if qw.fmt == "b4":  # [tile, pair, chunk, lane, 4]: low nibble block 2p, high 2p + 1
        b = qw.qweight.view(tiles, kp // PAIR, 8, TILE, 4)[tile, :, :, lane]  # [R, pairs, 8, 4]
        q = torch.stack((b & 0x0F, b >> 4), dim=2).reshape(rows.numel(), kp)
    else:
        q = qw.qweight.view(tiles, nb, 8, TILE, 4)[tile, :, :, lane].reshape(rows.numel(), kp)
    if qw.fmt == "c8":
        s = qw.scales[rows].float()[:, None].expand(rows.numel(), nb)
        return q, s, -128.0 * s
    d = qw.scales.view(tiles, nb, TILE)[tile, :, lane].float()
    m = qw.offsets.view(tiles, nb, TILE)[tile, :, lane].float()
    return q, d, m


class _DenseScratch(threading.local):
    """The dense fallback's per-thread dequantized weights, one grow-only buffer per dtype."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype) -> Tensor:
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype)
            self.buffers[dtype] = buf
        return buf


_dense_scratch = _DenseScratch()


class _ActScratch(threading.local):
    """The one owner of the int8 activations' per-thread buffers (xq, xd, xs), grow-only.

    quant_gemm takes their addresses (pointers: no tensor work on the decode hot path) and
    quantize_activations views of them (views). Either way the contents belong to this thread's
    latest call that quantizes activations: a view stays valid until the thread's next
    quant_gemm / quant_linear / quantize_activations (clone it to keep it). Per thread, so
    threads never share a buffer; a buffer outgrown is replaced, never written again.
    """

    def __init__(self) -> None:
        self.rows = self.kp = -1
        self.ptrs = (0, 0, 0)
        self.tensors: tuple[Tensor, ...] = ()

    def pointers(self, rows: int, kp: int) -> tuple[int, int, int]:
        """Addresses of xq (int8, rows * kp), xd and xs (float32, rows * kp / 32 each)."""
        if rows > self.rows or kp > self.kp:  # (xd, xs need rows * kp / 32 floats)
            self.rows, self.kp = max(rows, self.rows), max(kp, self.kp)
            n = self.rows * self.kp
            self.tensors = (torch.empty(n, dtype=torch.int8), torch.empty(n // BLOCK, dtype=torch.float32),
                            torch.empty(n // BLOCK, dtype=torch.float32))
            self.ptrs = tuple(t.data_ptr() for t in self.tensors)  # type: ignore[assignment]
        return self.ptrs

    def views(self, rows: int, kp: int, groups: int) -> tuple[Tensor, Tensor, Tensor]:
        """xq int8 [rows, kp], xd and xs float32 [rows, groups] (groups <= kp / 32) over the buffers."""
        self.pointers(rows, kp)
        xq, xd, xs = self.tensors
        return (xq[: rows * kp].view(rows, kp), xd[: rows * groups].view(rows, groups),
                xs[: rows * groups].view(rows, groups))


_act_scratch = _ActScratch()


# What quantize_act / quant_linear_act read (cpu_common.h ACT_*).
_ACT_F32, _ACT_BF16, _ACT_SWIGLU_BF16 = 0, 1, 2


def _act_kind(x: Tensor, swiglu: bool) -> int:
    return _ACT_SWIGLU_BF16 if swiglu else _ACT_BF16 if x.dtype == torch.bfloat16 else _ACT_F32


def _check_x(x: Tensor, qw: QuantWeight, swiglu: bool = False) -> None:
    width = 2 * qw.in_features if swiglu else qw.in_features
    dtypes = (torch.bfloat16,) if swiglu else (torch.bfloat16, torch.float32)
    if (x.dim() != 2 or x.dtype not in dtypes or x.device.type != "cpu"
            or x.stride(1) != 1 or x.shape[1] != width):
        what = "bf16 CPU tensor [M, 2 x" if swiglu else "bf16/float32 CPU tensor [M,"
        raise ValueError(f"x must be a 2-D {what} {qw.in_features}] "
                         f"contiguous along its last axis, got {x.dtype} {tuple(x.shape)} "
                         f"strides {x.stride()}")


def quantize_activations(x: Tensor, padded_in: int, per_token: bool, scalar: bool = False,
                         swiglu: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(xq int8 [M, Kp], scales, sums) as quant_gemm reads them: views of this thread's activation
    scratch, the one quant_gemm quantizes into, so valid until the thread's next quant_gemm,
    quant_linear or quantize_activations (clone them to keep them). swiglu: x is bf16 gate | up
    [M, 2K] and silu(gate) * up is quantized (quant_gemm's swiglu)."""
    rows, k = x.shape
    kind = _act_kind(x, swiglu)
    if swiglu:
        if x.dtype != torch.bfloat16 or k % 2:
            raise ValueError(f"swiglu needs bf16 gate | up rows of even width, got {x.dtype} {tuple(x.shape)}")
        k //= 2
    groups = 1 if per_token else padded_in // BLOCK
    xq, xd, xs = _act_scratch.views(rows, padded_in, groups)
    _library(scalar).quantize_act(x.data_ptr(), x.stride(0), kind, rows, k, padded_in, int(per_token),
                                  xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs


def quant_gemm(x: Tensor, qw: QuantWeight, bias: Tensor | None = None, scalar: bool = False,
               out_dtype: torch.dtype | None = None, swiglu: bool = False) -> Tensor:
    """x [M, K] @ W^T (+ bias float32 [N]) with int8 activations; output in out_dtype (bf16 or
    float32; default x's dtype), rounded once from the kernel's float32 sums.

    swiglu: x is bf16 [M, 2K], gate | up, and the activations are silu(gate) * up, computed in
    float32 as they are quantized (SwiGLU's down projection, with no [M, K] intermediate)."""
    _check_x(x, qw, swiglu)
    rows = x.shape[0]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    out = torch.empty(rows, qw.out_features, dtype=out_dtype)
    if rows == 0:
        return out
    if qw.kernel_args is None:
        qw.kernel_args = (FORMATS[qw.fmt], qw.out_features, qw.in_features, qw.padded_in,
                          qw.qweight.data_ptr(), qw.scales.data_ptr(),
                          qw.offsets.data_ptr() if qw.offsets is not None else 0)
    fmt, n, k, kp, w, wd, wm = qw.kernel_args
    xq, xd, xs = _act_scratch.pointers(rows, kp)  # the activations' int8 copy, quantized in the call
    _library(scalar).quant_linear_act(fmt, rows, n, k, kp, w, wd, wm or None,
                                      bias.data_ptr() if bias is not None else None, x.data_ptr(),
                                      x.stride(0), _act_kind(x, swiglu), xq, xd, xs,
                                      out.data_ptr(), out.stride(0), int(out_dtype == torch.bfloat16))
    return out


def dequantize(qw: QuantWeight, dtype: torch.dtype = torch.float32, out: Tensor | None = None,
               scalar: bool = False) -> Tensor:
    """The dense weights [N, K] in dtype (bf16 or float32), written into `out` if given."""
    if out is None:
        out = torch.empty(qw.out_features, qw.in_features, dtype=dtype)
    _library(scalar).quant_dequantize(
        FORMATS[qw.fmt], 0, qw.out_features, qw.in_features, qw.padded_in, qw.qweight.data_ptr(),
        qw.scales.data_ptr(), qw.offsets.data_ptr() if qw.offsets is not None else None,
        out.data_ptr(), int(out.dtype == torch.bfloat16))
    return out


def quant_linear(x: Tensor, qw: QuantWeight, bias: Tensor | None = None,
                 out_dtype: torch.dtype | None = None, swiglu: bool = False) -> Tensor:
    """The layer's forward: the int8 GEMM, or (block formats, many rows) dequantize + torch.
    out_dtype: the output's (bf16 or float32; default x's dtype); swiglu: x is gate | up, bf16
    [M, 2K], and the input is silu(gate) * up (quant_gemm)."""
    if swiglu:
        if x.dim() != 2 or x.shape[1] != 2 * qw.in_features:
            raise ValueError(f"swiglu needs gate | up rows [M, {2 * qw.in_features}], got {tuple(x.shape)}")
        if x.dtype == torch.bfloat16 and (qw.fmt == "c8" or x.shape[0] <= DENSE_ROWS):
            return quant_gemm(x, qw, bias, out_dtype=out_dtype, swiglu=True)
        if x.dtype == torch.bfloat16 and x.stride(1) == 1 and cpu_ops.load() is not None:
            act = cpu_ops.silu_and_mul(x)  # the dense path's many rows: rounded once, as SiluAndMul
        else:
            gate, up = x.split(qw.in_features, dim=-1)  # float32: torch's ops, as SiluAndMul
            act = F.silu(gate) * up
        return quant_linear(act, qw, bias, out_dtype)
    if qw.fmt != "c8" and x.shape[0] > DENSE_ROWS:
        numel = qw.out_features * qw.in_features
        w = _dense_scratch.get(numel, x.dtype)[:numel].view(qw.out_features, qw.in_features)
        dequantize(qw, x.dtype, out=w)
        out = F.linear(x, w, None if bias is None else bias.to(x.dtype))
        return out if out_dtype is None else out.to(out_dtype)
    return quant_gemm(x, qw, bias, out_dtype=out_dtype)


def embedding_rows(qw: QuantWeight, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows `ids` of the dense weights, in dtype: an embedding lookup in packed weights."""
    k = qw.in_features
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel():
        low, high = (int(v) for v in torch.aminmax(flat))  # one pass (every decode step)
        if low < 0 or high >= qw.out_features:
            raise IndexError(f"embedding ids must be in [0, {qw.out_features}), got {low}..{high}")
    if dtype not in (torch.bfloat16, torch.float32):
        return embedding_rows(qw, ids, torch.float32).to(dtype)
    out = torch.empty(flat.numel(), k, dtype=dtype)
    if flat.numel():
        _library().quant_rows(FORMATS[qw.fmt], flat.data_ptr(), flat.numel(), k, qw.padded_in,
                              qw.qweight.data_ptr(), qw.scales.data_ptr(),
                              qw.offsets.data_ptr() if qw.offsets is not None else None, out.data_ptr(),
                              int(dtype == torch.bfloat16))
    return out.view(*ids.shape, k)
