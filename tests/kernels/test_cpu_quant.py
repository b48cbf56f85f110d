"""The quantized CPU GEMM (lm_console/kernels/cpu_quant.py) against float64 references.

Each layout (b8, b4, c8) is checked twice: against a float64 product of the kernel's own int8
activations with the exact dense weights (only float32 summation noise, and the bf16 rounding of
the output, may differ), and against the float64 product of the unquantized activations (the
activation quantization error, a known bound). Both the AVX512-VNNI build and the portable
(-DLMC_SCALAR) build run; K = 80 leaves a partial block and padding.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from lm_console.engine import envs
from lm_console.kernels import cpu_quant
from lm_console.kernels.cpu_build import kernels_disabled

_NO_COMPILER = kernels_disabled() or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
pytestmark = pytest.mark.skipif(_NO_COMPILER, reason="no C compiler (or LMC_CPU_KERNELS=0): no quantized kernels")


def test_kernels_build_where_a_compiler_exists():
    """A build error fails here instead of skipping every test below."""
    assert cpu_quant.load() is not None and cpu_quant.load(scalar=True) is not None

N, K = 70, 80  # 70 rows: 4 full tiles of 16 and a partial one; K: 2.5 blocks, padded to 128


def _block_weight(fmt: str, seed: int = 0) -> tuple[cpu_quant.QuantWeight, np.ndarray]:
    rng = np.random.default_rng(seed)
    nb = -(-K // cpu_quant.BLOCK)
    q = rng.integers(0, 16 if fmt == "b4" else 256, (N, K)).astype(np.uint8)
    d = (rng.random((N, nb)) * 0.02 + 0.001).astype(np.float16)
    m = (-rng.random((N, nb)) * (0.15 if fmt == "b4" else 2.0)).astype(np.float16)
    dense = (q * np.repeat(d.astype(np.float64), 32, 1)[:, :K]
             + np.repeat(m.astype(np.float64), 32, 1)[:, :K])
    return cpu_quant.pack_blocks(fmt, q, d, m, "test"), dense


def _weights(fmt: str) -> tuple[cpu_quant.QuantWeight, np.ndarray]:
    if fmt == "c8":
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
        qw = cpu_quant.quantize_int8_per_channel(w)
        q = torch.round(w / qw.scales[:N, None]).double() + 128  # the stored unsigned values
        dense = ((q - 128) * qw.scales[:N].double()[:, None]).numpy()
        return qw, dense
    return _block_weight(fmt)


def _dequantized_activations(x: torch.Tensor, padded_in: int, per_token: bool, scalar: bool) -> np.ndarray:
    xq, xd, _ = cpu_quant.quantize_activations(x, padded_in, per_token, scalar)
    xq = xq.double().numpy()[:, :K]
    scales = xd.double().numpy()
    expanded = scales if per_token else np.repeat(scales, cpu_quant.BLOCK, 1)[:, :K]
    return xq * expanded


@pytest.mark.parametrize("scalar", [False, True], ids=["native", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["b8", "b4", "c8"])
@pytest.mark.parametrize("rows", [1, 6, 12, 19, 131])  # 19: register tiles of 16 + 3; 131: chunks of 128 + 3
def test_quant_gemm_matches_float64(fmt, dtype, scalar, rows):
    qw, dense = _weights(fmt)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(2)).to(dtype)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3))
    out = cpu_quant.quant_gemm(x, qw, bias, scalar=scalar)
    assert out.dtype == dtype and out.shape == (rows, N)
    xdq = _dequantized_activations(x, qw.padded_in, False, scalar)
    ref = xdq @ dense.T + bias.double().numpy()
    tol = 2.0**-8 if dtype == torch.bfloat16 else 1e-5
    err = np.abs(out.double().numpy() - ref) / (np.abs(ref) + np.abs(xdq) @ np.abs(dense).T * 1e-6 + 1e-30)
    assert np.median(err) < tol and np.max(np.abs(out.double().numpy() - ref)) <= tol * np.abs(ref).max() * 4
    # against the unquantized activations: int8 rounding moves each by at most scale / 2
    exact = x.double().numpy() @ dense.T + bias.double().numpy()
    bound = (np.abs(x.double().numpy() - xdq) @ np.abs(dense).T) * 1.01 + tol * np.abs(exact) + 1e-6
    assert np.all(np.abs(out.double().numpy() - exact) <= bound)
    assert np.abs(x.double().numpy() - xdq).max() <= np.abs(x.double().numpy()).max() / 127 / 2 * 1.001


@pytest.mark.parametrize("scalar", [False, True], ids=["native", "scalar"])
@pytest.mark.parametrize("fmt", ["b8", "b4"])
def test_quant_gemm_float32_output_from_bf16_rows(fmt, scalar, monkeypatch):
    """bf16 activations with out_dtype=float32 (the lm_head's logits): the kernel's float32 sums as
    they are, which the default bf16 output is the rounding of."""
    # The entry point's check below is of the int8 kernel's path: on an AMX machine DENSE_ROWS
    # would send 19 rows to dequantize + torch (tested on its own with DENSE_ROWS lowered).
    monkeypatch.setattr(cpu_quant, "DENSE_ROWS", 1 << 40)
    qw, _ = _weights(fmt)
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(6)).bfloat16()
    wide = cpu_quant.quant_gemm(x, qw, scalar=scalar, out_dtype=torch.float32)
    narrow = cpu_quant.quant_gemm(x, qw, scalar=scalar)
    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
    assert torch.equal(wide.bfloat16(), narrow)
    assert not torch.equal(wide, narrow.float())  # not a bf16 value widened
    if not scalar:  # the layer's entry point (native library) passes it on
        assert torch.equal(cpu_quant.quant_linear(x, qw, out_dtype=torch.float32), wide)
    with pytest.raises(ValueError, match="out_dtype"):
        cpu_quant.quant_gemm(x, qw, out_dtype=torch.float16)


@pytest.mark.parametrize("scalar", [False, True], ids=["native", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_activation_quantization(per_token, dtype, scalar):
    x = (torch.randn(3, K, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    x[1] = 0  # an all-zero row quantizes to zeros with scale 0
    kp = cpu_quant.padded(K)
    xq, xd, xs = (t.clone() for t in cpu_quant.quantize_activations(x, kp, per_token, scalar))
    if not scalar:  # the vectorized path rounds as the portable one does: the same values
        ref = cpu_quant.quantize_activations(x, kp, per_token, True)  # (the same scratch buffers)
        assert all(torch.equal(a, b) for a, b in zip((xq, xd, xs), ref))
    x = x.float()
    assert xq.shape == (3, kp) and torch.all(xq[:, K:] == 0)
    assert torch.all(xq.abs() <= 127)
    if per_token:
        assert torch.allclose(xd[:, 0], x.abs().amax(1) / 127)
        assert torch.equal(xs[:, 0], xq.sum(1).float())
    else:
        blocks = torch.nn.functional.pad(x, (0, kp - K)).view(3, -1, cpu_quant.BLOCK)
        assert torch.allclose(xd, blocks.abs().amax(-1) / 127)
        assert torch.allclose(xs, xd * xq.view(3, -1, cpu_quant.BLOCK).sum(-1).float())
    assert torch.all(xq[1] == 0) and torch.all(xd[1] == 0)


def test_one_activation_scratch_per_thread():
    """quant_gemm and quantize_activations quantize into the same per-thread buffers (one owner)."""
    import threading

    qw, _ = _weights("b8")
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(5))
    cpu_quant.quant_gemm(x, qw)  # leaves x's int8 copy in this thread's scratch
    left = cpu_quant._act_scratch.views(5, qw.padded_in, qw.padded_in // cpu_quant.BLOCK)
    left = tuple(t.clone() for t in left)
    xq, xd, xs = cpu_quant.quantize_activations(x, qw.padded_in, per_token=False)
    assert xq.data_ptr() == cpu_quant._act_scratch.pointers(5, qw.padded_in)[0]  # the same buffer
    assert all(torch.equal(a, b) for a, b in zip(left, (xq, xd, xs)))  # and the same quantization
    seen = {}

    def other_thread() -> None:
        seen["ptr"] = cpu_quant.quantize_activations(x, qw.padded_in, per_token=False)[0].data_ptr()

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert seen["ptr"] != xq.data_ptr()  # another thread never writes this thread's buffers
    assert torch.equal(xq, left[0])


@pytest.mark.parametrize("scalar", [False, True], ids=["native", "scalar"])
@pytest.mark.parametrize("fmt", ["b8", "b4", "c8"])
def test_dequantize_and_embedding_rows(fmt, scalar):
    qw, dense = _weights(fmt)
    out = cpu_quant.dequantize(qw, torch.float32, scalar=scalar).double().numpy()
    assert np.abs(out - dense).max() <= 1e-6 * np.abs(dense).max()
    bf16 = cpu_quant.dequantize(qw, torch.bfloat16, scalar=scalar)
    assert torch.equal(bf16, torch.from_numpy(out).float().bfloat16())
    ids = torch.tensor([[3, 0], [69, 3]])
    rows = cpu_quant.embedding_rows(qw, ids, torch.float32)
    assert rows.shape == (2, 2, K)
    assert np.abs(rows.double().numpy() - dense[ids.numpy()]).max() <= 1e-6 * np.abs(dense).max()
    # the lookup gives dequantize's values exactly, whatever the batch
    native_bf16 = cpu_quant.dequantize(qw, torch.bfloat16)
    assert torch.equal(cpu_quant.embedding_rows(qw, ids, torch.bfloat16), native_bf16[ids])
    assert torch.equal(cpu_quant.embedding_rows(qw, ids[0, :1], torch.bfloat16), native_bf16[ids[0, :1]])
    with pytest.raises(IndexError, match=r"\[0, 70\)"):
        cpu_quant.embedding_rows(qw, torch.tensor([70]), torch.float32)


def test_int8_per_channel_quantization():
    w = torch.randn(5, K, generator=torch.Generator().manual_seed(5))
    w[2] = 0
    qw = cpu_quant.quantize_int8_per_channel(w)
    back = cpu_quant.dequantize(qw)
    assert torch.all((back - w).abs() <= qw.scales[:5, None] / 2 + 1e-7)
    assert torch.all(back[2] == 0)


def test_quant_linear_dense_path_for_many_rows(monkeypatch):
    """Above dense_rows() rows the block formats multiply dequantized weights with torch."""
    monkeypatch.setattr(cpu_quant, "DENSE_ROWS", 4)
    qw, dense = _block_weight("b4")
    rows = cpu_quant.dense_rows() + 1
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(6))
    out = cpu_quant.quant_linear(x, qw)
    ref = x.double().numpy() @ dense.T
    assert np.abs(out.double().numpy() - ref).max() <= 1e-4 * np.abs(ref).max()


def test_bad_input_is_refused():
    qw, _ = _block_weight("b8")
    with pytest.raises(ValueError, match="contiguous along its last axis"):
        cpu_quant.quant_gemm(torch.randn(K, 3).t(), qw)
    with pytest.raises(ValueError, match=r"\[M, 80\]"):
        cpu_quant.quant_gemm(torch.randn(2, K + 1), qw)


@pytest.mark.parametrize("fmt", ["b8", "b4", "c8"])
def test_tiled_layout_round_trip(fmt):
    """The packed tiles give back every row's values, scales and offsets (padding: zero rows)."""
    qw, dense = _weights(fmt)
    assert qw.qweight.shape[0] == qw.padded_out // cpu_quant.TILE == 5
    rows = torch.arange(qw.padded_out)
    q, d, m = cpu_quant.unpack_rows(qw, rows)
    w = (q.double() * d.double().repeat_interleave(cpu_quant.BLOCK, 1)
         + m.double().repeat_interleave(cpu_quant.BLOCK, 1)).numpy()
    assert np.abs(w[:N, :K] - dense).max() <= 1e-6 * np.abs(dense).max()
    # padding rows and whole padding blocks are zero (x is zero past K, so a partial block's
    # offset over its padding does not count)
    assert np.all(w[N:] == 0) and np.all(w[:, -(-K // 32) * 32:] == 0)


def _gate_up(rows: int, seed: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 gate | up rows [rows, 2K] and their SwiGLU activation silu(gate) * up in float64."""
    gate_up = (torch.randn(rows, 2 * K, generator=torch.Generator().manual_seed(seed)) * 4).bfloat16()
    gate, up = gate_up.double().split(K, dim=1)
    return gate_up, gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("scalar", [False, True], ids=["native", "scalar"])
@pytest.mark.parametrize("per_token", [False, True])
def test_swiglu_activations_quantize_silu_gate_times_up(per_token, scalar):
    """The down projection's input silu(gate) * up is computed in float32 as it is quantized: its
    int8 values and scales are those of the float64 activation (a value on a rounding boundary may
    land one step over), never a stored bf16 intermediate."""
    gate_up, act = _gate_up(21)
    gate_up[3] = 0  # silu(0) * 0: a zero row
    gate_up[4, :K:2] = -100.0  # silu(-100) ~ -4e-42: no overflow in exp
    gate, up = gate_up[3:5].double().split(K, dim=1)
    act[3:5] = gate * torch.sigmoid(gate) * up
    kp = cpu_quant.padded(K)
    xq, xd, _ = (t.clone() for t in cpu_quant.quantize_activations(gate_up, kp, per_token, scalar, swiglu=True))
    rq, rd, _ = cpu_quant.quantize_activations(act.float(), kp, per_token, scalar)
    assert torch.allclose(xd, rd, rtol=1e-5, atol=0)
    assert (xq.int() - rq.int()).abs().max() <= 1 and (xq != rq).float().mean() < 0.01
    scales = xd.double() if per_token else xd.double().repeat_interleave(cpu_quant.BLOCK, 1)[:, :K]
    assert torch.all((xq[:, :K].double() * scales - act).abs() <= scales / 2 * 1.01 + 1e-12)
    assert torch.all(xq[3] == 0) and torch.all(xq[:, K:] == 0)


@pytest.mark.parametrize("scalar", [False, True], ids=["native", "scalar"])
@pytest.mark.parametrize("fmt", ["b8", "b4", "c8"])
@pytest.mark.parametrize("rows", [1, 19, 131])
def test_swiglu_gemm_matches_float64(fmt, scalar, rows):
    qw, dense = _weights(fmt)
    gate_up, act = _gate_up(rows)
    out = cpu_quant.quant_gemm(gate_up, qw, scalar=scalar, swiglu=True)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, N)
    xq, xd, _ = cpu_quant.quantize_activations(gate_up, qw.padded_in, False, scalar, swiglu=True)
    xdq = xq.double().numpy()[:, :K] * np.repeat(xd.double().numpy(), cpu_quant.BLOCK, 1)[:, :K]
    ref = xdq @ dense.T
    assert np.abs(out.double().numpy() - ref).max() <= 2.0**-8 * np.abs(ref).max() * 4
    exact = act.numpy() @ dense.T  # the quantization error, bounded as for stored activations
    bound = (np.abs(act.numpy() - xdq) @ np.abs(dense).T) * 1.01 + 2.0**-8 * np.abs(exact) + 1e-6
    assert np.all(np.abs(out.double().numpy() - exact) <= bound)
    if not scalar:  # the layer's entry point takes the same path (the int8 kernel's: on an AMX
        # machine DENSE_ROWS sends many rows to dequantize + torch, tested on its own below)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpu_quant, "DENSE_ROWS", 1 << 40)
            assert torch.equal(cpu_quant.quant_linear(gate_up, qw, swiglu=True), out)


def test_swiglu_without_the_kernel_path_computes_the_same_product(monkeypatch):
    """float32 gate | up, and block formats above dense_rows() rows, apply silu(gate) * up with
    torch first; a width other than 2K is refused."""
    qw, dense = _weights("b4")
    gate_up, act = _gate_up(6)
    exact = act.numpy() @ dense.T
    fp32 = cpu_quant.quant_linear(gate_up.float(), qw, swiglu=True)
    assert fp32.dtype == torch.float32
    assert np.abs(fp32.double().numpy() - exact).max() <= 0.02 * np.abs(exact).max()
    monkeypatch.setattr(cpu_quant, "DENSE_ROWS", 4)
    many = cpu_quant.quant_linear(gate_up, qw, swiglu=True)
    assert np.abs(many.double().numpy() - exact).max() <= 0.02 * np.abs(exact).max()
    with pytest.raises(ValueError, match=r"gate \| up rows \[M, 160\]"):
        cpu_quant.quant_linear(gate_up[:, :-2], qw, swiglu=True)
    with pytest.raises(ValueError, match=r"\[M, 2 x 80\]"):
        cpu_quant.quant_gemm(gate_up.float(), qw, swiglu=True)


@pytest.fixture
def amx():
    """The AMX path on (skipped where the CPU, the build or the kernel lacks it); as it was after."""
    if not cpu_quant.set_amx(True):
        cpu_quant.set_amx(False)
        pytest.skip("no AMX tile unit here (CPU, compiler or kernel permission)")
    yield
    cpu_quant.set_amx(not envs.LMC_QUANT_AMX.is_off())


@pytest.mark.parametrize("fmt", ["b8", "b4", "c8"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_amx_path_is_bit_identical_to_vnni(fmt, out_dtype, amx):
    """The tile unit's block sums are the same integers and the epilogue the same instructions:
    every output of every batch size (passes of 16-32 tokens on AMX, the rest on VNNI) and the
    SwiGLU input are the same bits with AMX on and off, and the AMX path really ran."""
    qw, _ = _weights(fmt)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3))
    for rows in (1, 15, 16, 17, 31, 32, 33, 48, 131, 300):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(out_dtype)
        gate_up, _ = _gate_up(rows)
        cpu_quant.set_amx(False)
        passes = cpu_quant.amx_calls()
        ref = cpu_quant.quant_gemm(x, qw, bias)
        ref_swiglu = cpu_quant.quant_gemm(gate_up, qw, swiglu=True)
        assert cpu_quant.amx_calls() == passes, "AMX off: no tile pass"
        cpu_quant.set_amx(True)
        got = cpu_quant.quant_gemm(x, qw, bias)
        got_swiglu = cpu_quant.quant_gemm(gate_up, qw, swiglu=True)
        ran = cpu_quant.amx_calls() - passes
        assert (ran > 0) == (rows >= 16), f"{rows} rows: {ran} AMX calls"
        assert torch.equal(got, ref), f"{fmt}, {rows} rows"
        assert torch.equal(got_swiglu, ref_swiglu), f"{fmt}, {rows} rows, SwiGLU"

