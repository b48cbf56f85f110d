"""LogitsProjection: bf16 hidden states and head; each row's top logits in fp32 (no bf16 rounding
where the argmax and the top logprobs are decided), the rest at bf16 speed."""

from __future__ import annotations

import pytest
import torch

from lm_console.engine.models.layers import Linear, LogitsProjection
from lm_console.kernels import cpu_quant


def _head(dtype: torch.dtype, bias: bool = False) -> Linear:
    torch.manual_seed(0)
    head = Linear(64, 500, bias, dtype)
    head.weight.data.copy_(torch.randn(500, 64) * 2)  # logits of a few units: bf16 steps of ~1/32
    if bias:
        head.bias.data.copy_(torch.randn(500))
    return head


def test_the_top_of_each_row_is_fp32_and_the_rest_within_bf16_rounding() -> None:
    head, project = _head(torch.bfloat16, bias=True), LogitsProjection()
    hidden = torch.randn(7, 64).to(torch.bfloat16)
    exact = hidden.double() @ head.weight.double().t() + head.bias.double()
    logits = project(hidden, head)
    assert logits.dtype == torch.float32 and logits.shape == (7, 500)
    top = exact >= exact.amax(dim=-1, keepdim=True) - 0.5
    assert (logits.double() - exact)[top].abs().max() < 1e-4  # the contenders: fp32
    scale = exact.abs().amax(dim=-1, keepdim=True)
    assert ((logits.double() - exact).abs() <= scale * 2.0 ** -8).all()  # the rest: bf16 rounding
    rounded = head(hidden).float()  # what a bf16 head returns: rounded to 8 bits of mantissa
    assert (rounded.double() - exact)[top].abs().max() > 1e-3


def test_greedy_choice_is_the_fp32_argmax_even_for_near_ties() -> None:
    head, project = _head(torch.bfloat16), LogitsProjection()
    torch.manual_seed(1)
    hidden = torch.randn(200, 64).to(torch.bfloat16)
    w = head.weight.data
    # Near ties: token 1's row is token 0's plus a tiny nudge, so their logits differ by ~1e-3.
    w[1] = (w[0].float() + torch.randn(64) * 2.0 ** -7).to(torch.bfloat16)
    w[0] = w[0] * 1.0  # bf16 already
    hidden[:, :] = hidden + (w[0].float() * 0.5).to(torch.bfloat16)  # make tokens 0 / 1 the top
    exact = hidden.double() @ w.double().t()
    assert torch.equal(project(hidden, head).argmax(dim=-1), exact.argmax(dim=-1))


def test_a_row_gives_the_same_logits_alone_and_in_a_batch() -> None:
    head, project = _head(torch.bfloat16), LogitsProjection()
    hidden = torch.randn(9, 64).to(torch.bfloat16)
    batch = project(hidden, head)
    for i in range(9):
        alone = project(hidden[i:i + 1], head)[0]
        top = batch[i] >= batch[i].max() - 0.25
        assert torch.equal(alone[top], batch[i][top])


def test_fp32_head_is_a_plain_linear() -> None:
    head, project = _head(torch.float32), LogitsProjection()
    hidden = torch.randn(3, 64)
    assert torch.equal(project(hidden, head), head(hidden))


def test_quantized_head_logits_are_the_kernels_float32_sums() -> None:
    """A packed (quantized) head: the int8 kernel writes float32 logits directly, not a bf16
    output widened (the rounding the dense head's fp32 refine exists to undo)."""
    if cpu_quant.load() is None:
        pytest.skip("no C compiler: the quantized kernels are unavailable")
    head = Linear(64, 512, False, torch.bfloat16)
    head.weight.data = torch.randn(512, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    head.set_quant_weight(cpu_quant.quantize_int8_per_channel(head.weight.float()))
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    logits = LogitsProjection()(hidden, head)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, cpu_quant.quant_gemm(hidden, head.quant, out_dtype=torch.float32))
    assert torch.equal(logits.bfloat16(), head(hidden))  # the layer's bf16 output is its rounding
