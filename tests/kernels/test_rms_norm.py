"""RMSNorm and fused residual-add + RMSNorm against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import DEVICE, ON_GPU, REL_TOL, rel_err
from lm_console.kernels.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_ref

NUM_TOKENS, HIDDEN = (4096, 4096) if ON_GPU else (6, 80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_and_fused_add(dtype):
    x = torch.randn(NUM_TOKENS, HIDDEN, device=DEVICE).to(dtype)
    residual = torch.randn(NUM_TOKENS, HIDDEN, device=DEVICE).to(dtype)
    weight = (1.0 + 0.1 * torch.randn(HIDDEN, device=DEVICE)).to(dtype)
    ref, _ = rms_norm_ref(x, weight, 1e-6)
    assert rel_err(rms_norm(x, weight, 1e-6), ref) < REL_TOL[dtype]

    ref, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    fused_add_rms_norm(x, residual, weight, 1e-6)  # in place
    assert rel_err(x, ref) < REL_TOL[dtype]
    assert rel_err(residual, ref_residual) < REL_TOL[dtype]


def test_strided_rows():
    """Rows of a wider buffer (a view) are normalised without touching the gaps."""
    buf = torch.randn(4, 2 * 64, device=DEVICE)
    x = buf[:, :64]
    weight = torch.ones(64, device=DEVICE)
    ref, _ = rms_norm_ref(x, weight, 1e-5)
    assert rel_err(rms_norm(x, weight, 1e-5), ref) < 1e-5
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:10], 1e-5)
