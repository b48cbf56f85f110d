"""The fused bf16 CPU kernels (lm_console/kernels/cpu_ops.py) against float64 references.

Each kernel computes in float32 and rounds once, so every output is within half a bf16 ulp
(relative 2**-8) of the exact value, plus float32 noise; they are checked against that bound
and against torch's own bf16 op sequence, whose error they must not exceed. Both the AVX-512
build and a scalar-only build (-DLMC_SCALAR) are exercised; odd widths hit the masked tails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lm_console.kernels import cpu_build, cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.load() is None,
                                reason="no C compiler (or LMC_CPU_KERNELS=0): torch path only")

HALF_ULP = 2.0**-8


@pytest.fixture(params=["native", "scalar"])
def library(request, monkeypatch):
    """Run the test on the native build, then on the scalar build of the same source."""
    if request.param == "scalar":
        scalar = cpu_build.load_library(cpu_ops.SOURCE, "scalar fused kernels", ("LMC_SCALAR",))
        assert scalar is not None
        monkeypatch.setattr(cpu_ops, "load", lambda: cpu_ops.bind(scalar))
    return request.param


def _assert_rounded_once(out: torch.Tensor, exact: torch.Tensor) -> None:
    """out (bf16) is exact (float64) rounded to bf16, up to float32 noise."""
    err = (out.double() - exact).abs()
    bound = HALF_ULP * exact.abs() + 1e-6 * (1 + exact.abs().max())
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


def _rows(rows: int, width: int, row_stride: int, seed: int) -> torch.Tensor:
    """A [rows, width] bf16 view with the given row stride (a slice of a wider buffer)."""
    gen = torch.Generator().manual_seed(seed)
    buf = (torch.randn(rows, row_stride, generator=gen) * 2).bfloat16()
    return buf[:, :width]


SHAPES = [(1, 1), (3, 15), (2, 16), (5, 17), (4, 33), (2, 576), (64, 1536)]  # last: threaded


@pytest.mark.parametrize("rows,d", SHAPES)
@pytest.mark.parametrize("padded", [False, True])
def test_silu_and_mul(library, rows, d, padded):
    x = _rows(rows, 2 * d, 2 * d + (7 if padded else 0), seed=d)
    out = cpu_ops.silu_and_mul(x)
    gate, up = x.double().split(d, dim=-1)
    exact = F.silu(gate) * up
    _assert_rounded_once(out, exact)
    torch_err = (F.silu(x[:, :d]) * x[:, d:]).double().sub(exact).abs().max()
    assert (out.double() - exact).abs().max() <= torch_err


def test_silu_and_mul_extreme_gates(library):
    x = torch.tensor([[-200.0, -30.0, 0.0, 30.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]]).bfloat16()
    out = cpu_ops.silu_and_mul(x).double()
    gate, up = x.double().split(5, dim=-1)
    _assert_rounded_once(cpu_ops.silu_and_mul(x), F.silu(gate) * up)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("rows,d", SHAPES)
@pytest.mark.parametrize("padded", [False, True])
def test_rms_norm(library, rows, d, padded):
    x = _rows(rows, d, d + (5 if padded else 0), seed=d)
    weight = (torch.rand(d, generator=torch.Generator().manual_seed(1)) + 0.5).bfloat16()
    out = cpu_ops.rms_norm(x, weight, 1e-5)
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    _assert_rounded_once(out, exact)
    torch_seq = weight * F.rms_norm(x.float(), (d,), eps=1e-5).bfloat16()  # what RMSNorm did
    assert (out.double() - exact).abs().max() <= (torch_seq.double() - exact).abs().max()


@pytest.mark.parametrize("rows,d", SHAPES)
@pytest.mark.parametrize("padded", [False, True])
def test_add_rms_norm(library, rows, d, padded):
    x = _rows(rows, d, d + (3 if padded else 0), seed=d)
    residual = _rows(rows, d, d + (9 if padded else 0), seed=d + 1)
    residual_before = residual.clone()
    weight = (torch.rand(d, generator=torch.Generator().manual_seed(2)) + 0.5).bfloat16()
    expected_sum = x + residual  # torch's bf16 add: the residual stream must match it exactly
    out = cpu_ops.add_rms_norm_(x, residual, weight, 1e-6)
    assert torch.equal(x, expected_sum)
    assert torch.equal(residual, residual_before)
    s = expected_sum.double()
    exact = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    _assert_rounded_once(out, exact)


@pytest.mark.parametrize("tokens,heads,extra_heads,head_dim",
                         [(1, 1, 0, 2), (3, 2, 3, 20), (4, 16, 8, 128), (300, 12, 3, 64)])
def test_rms_norm_heads_in_place(library, tokens, heads, extra_heads, head_dim):
    x = _rows(tokens, (heads + extra_heads) * head_dim, (heads + extra_heads) * head_dim + 2,
              seed=heads)
    before = x.clone()
    weight = (torch.rand(head_dim, generator=torch.Generator().manual_seed(3)) + 0.5).bfloat16()
    cpu_ops.rms_norm_heads_(x, heads, head_dim, weight, 1e-6)
    h = before[:, : heads * head_dim].double().view(tokens, heads, head_dim)
    exact = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    _assert_rounded_once(x[:, : heads * head_dim], exact.view(tokens, -1))
    assert torch.equal(x[:, heads * head_dim :], before[:, heads * head_dim :])


def _rope_tables(tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens)
    angles = torch.rand(tokens, head_dim // 2, generator=gen, dtype=torch.float64) * 100
    return angles.cos().float(), angles.sin().float()


@pytest.mark.parametrize("tokens,heads,extra_heads,head_dim",
                         [(1, 1, 0, 2), (3, 3, 2, 6), (5, 12, 3, 64), (2, 4, 1, 80), (300, 12, 3, 64)])
def test_rotary_in_place_on_the_leading_heads(library, tokens, heads, extra_heads, head_dim):
    x = _rows(tokens, (heads + extra_heads) * head_dim, (heads + extra_heads) * head_dim + 4,
              seed=head_dim)
    before = x.clone()
    cos, sin = _rope_tables(tokens, head_dim)
    cpu_ops.rotary_neox_(x, heads, head_dim, cos, sin)
    half = head_dim // 2
    h = before[:, : heads * head_dim].double().view(tokens, heads, head_dim)
    x1, x2 = h[..., :half], h[..., half:]
    c, s = cos.double()[:, None], sin.double()[:, None]
    exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).view(tokens, -1)
    _assert_rounded_once(x[:, : heads * head_dim], exact)
    assert torch.equal(x[:, heads * head_dim :], before[:, heads * head_dim :])  # v untouched


def test_bad_inputs_raise_specific_errors():
    with pytest.raises(ValueError, match="bf16"):
        cpu_ops.silu_and_mul(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="even"):
        cpu_ops.silu_and_mul(torch.zeros(2, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous along its last axis"):
        cpu_ops.rms_norm(torch.zeros(4, 2, dtype=torch.bfloat16).t(),
                         torch.ones(4, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.rms_norm(torch.zeros(2, 4, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        cpu_ops.add_rms_norm_(torch.zeros(2, 4, dtype=torch.bfloat16),
                              torch.zeros(3, 4, dtype=torch.bfloat16),
                              torch.ones(4, dtype=torch.bfloat16), 1e-6)
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_ops.rms_norm_heads_(x, 3, 4, torch.ones(4, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.rms_norm_heads_(x, 2, 4, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_ops.rotary_neox_(x, 3, 4, torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.rotary_neox_(x, 2, 4, torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2))


def test_disabled_by_env_falls_back(monkeypatch):
    monkeypatch.setenv("LMC_CPU_KERNELS", "0")
    cpu_ops.load.cache_clear()
    try:
        assert cpu_ops.load() is None
        assert not cpu_ops.enabled(torch.zeros(1, dtype=torch.bfloat16))
        with pytest.raises(cpu_build.CpuKernelBuildError):
            cpu_ops.silu_and_mul(torch.zeros(1, 2, dtype=torch.bfloat16))
    finally:
        monkeypatch.delenv("LMC_CPU_KERNELS")
        cpu_ops.load.cache_clear()
    assert cpu_ops.enabled(torch.zeros(1, dtype=torch.bfloat16))
    assert not cpu_ops.enabled(torch.zeros(1))  # float32 always takes the torch path


def test_loading_the_c_kernels_keeps_subnormal_floats() -> None:
    """No library turns on flush-to-zero for the process (GCC's crtfastmath.o does, if linked)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from lm_console.kernels import cpu_attention, cpu_build, cpu_ops, cpu_sampling\n"
        "libs = [cpu_build.load_library(m.SOURCE, 'x') for m in (cpu_ops, cpu_sampling)]\n"
        "libs.append(cpu_build.load_library(cpu_attention.SOURCES, 'x'))\n"
        "tiny = sys.float_info.min\n"
        "print(sum(lib is not None for lib in libs), tiny / 4 > 0.0)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            cwd=str(Path(__file__).resolve().parents[2]))
    assert result.returncode == 0, result.stderr
    num_loaded, subnormals = result.stdout.split()
    if num_loaded == "0":
        pytest.skip("no C compiler: the kernels are not built here")
    assert subnormals == "True"  # a subnormal result survives after every library loaded
