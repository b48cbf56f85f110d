"""LogitsProjection: bf16 hidden states and head, fp32 accumulation and output (no bf16 rounding)."""

from __future__ import annotations

import torch

from engine.models.layers import Linear, LogitsProjection


def _head(dtype: torch.dtype) -> Linear:
    torch.manual_seed(0)
    head = Linear(64, 500, False, dtype)
    head.weight.data.copy_(torch.randn(500, 64) * 2)  # logits of a few units: bf16 steps of ~1/32
    return head


def test_bf16_head_returns_fp32_accumulated_logits() -> None:
    head, project = _head(torch.bfloat16), LogitsProjection()
    hidden = torch.randn(7, 64).to(torch.bfloat16)
    exact = hidden.double() @ head.weight.double().t()  # bf16 inputs, exact products and sums
    logits = project(hidden, head)
    assert logits.dtype == torch.float32 and logits.shape == (7, 500)
    assert (logits.double() - exact).abs().max() < 1e-4
    rounded = head(hidden).float()  # what a bf16 head returns: rounded to 8 bits of mantissa
    assert (rounded.double() - exact).abs().max() > 1e-2


def test_the_fp32_copy_follows_a_weight_update() -> None:
    head, project = _head(torch.bfloat16), LogitsProjection()
    hidden = torch.randn(2, 64).to(torch.bfloat16)
    first = project(hidden, head)
    with torch.no_grad():
        head.weight.mul_(2)  # in place: the version counter moves
    assert torch.allclose(project(hidden, head), 2 * first, rtol=1e-5, atol=1e-5)


def test_fp32_head_is_a_plain_linear() -> None:
    head, project = _head(torch.float32), LogitsProjection()
    hidden = torch.randn(3, 64)
    assert torch.equal(project(hidden, head), head(hidden))
