"""The decode-stack driver's own arithmetic (its dense bf16 GEMV) against a float64 reference.

The rest of the driver calls the engine's kernels (tested in their own files) and is checked
end to end against the layer-by-layer forward in tests/models/test_decode_stack.py.
"""

from __future__ import annotations

import pytest
import torch

from lm_console.kernels import cpu_decode

pytestmark = pytest.mark.skipif(cpu_decode.load() is None, reason="no C compiler (or LMC_CPU_KERNELS=0)")


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("rows,n,k", [(1, 64, 576), (3, 13, 96), (5, 7, 50)])
def test_dense_linear_matches_float64(scalar, rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    got = cpu_decode.dense_linear(x, w, bias, scalar=scalar).double()
    exact = x.double() @ w.double().T + bias.double()
    # one bf16 rounding of the result (2^-9 relative) plus float32 accumulation error
    bound = exact.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().T) * k * 2.0 ** -23
    assert (got - exact).abs().le(bound).all()
    no_bias = cpu_decode.dense_linear(x, w, None, scalar=scalar).double()
    assert (no_bias - (exact - bias.double())).abs().le(bound + bias.double().abs() * 2.0 ** -8).all()


def test_dense_linear_refuses_bad_inputs():
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="columns"):
        cpu_decode.dense_linear(x, torch.zeros(4, 9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        cpu_decode.dense_linear(x.float(), torch.zeros(4, 8, dtype=torch.bfloat16))


def test_driver_stays_off_when_a_kernel_signature_changes():
    from lm_console.kernels import cpu_quant

    fn = cpu_quant.load().quant_gemm
    saved = fn.argtypes
    cpu_decode.kernel_table.cache_clear()
    try:
        fn.argtypes = saved[:-1]  # as if quant_gemm.c had dropped an argument
        assert cpu_decode.kernel_table() is None
    finally:
        fn.argtypes = saved
        cpu_decode.kernel_table.cache_clear()
    assert cpu_decode.kernel_table() is not None
