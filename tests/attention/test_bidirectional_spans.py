"""Bidirectional image spans in the torch backend: the mask equals transformers' Gemma3 image
mask (built from its masking_utils), and the Attention layer routes such steps to the torch
backend whatever backend it was given."""

from __future__ import annotations


import pytest
import torch

from lm_console.engine.attention import Attention, AttentionMetadata
from lm_console.engine.attention.backend import AttentionBackend
from lm_console.engine.attention.torch_backend import _bidirectional_allowed
from lm_console.engine.forward_context import set_forward_context


def hf_mask(num_context: int, seq_len: int, window: int | None, spans: list[tuple[int, int]]) -> torch.Tensor:
    """HF's OR(causal, blockwise) [AND sliding window] over absolute positions."""
    from transformers.masking_utils import and_masks, blockwise_overlay, causal_mask_function, or_masks
    from transformers.masking_utils import sliding_window_overlay

    block_ids = torch.full((1, seq_len), -1)
    for i, (start, end) in enumerate(spans):
        block_ids[0, start:end] = i
    fn = or_masks(causal_mask_function, blockwise_overlay(block_ids))
    if window is not None:
        fn = and_masks(fn, sliding_window_overlay(window))
    zero, t = torch.tensor(0), torch.tensor
    return torch.tensor([[bool(fn(zero, zero, t(q), t(k))) for k in range(seq_len)]
                         for q in range(num_context, seq_len)])


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("num_context", [0, 4, 9])
def test_mask_equals_transformers(window, num_context) -> None:
    spans = [(5, 12), (13, 16)]  # the first may start before the chunk (a prefix hit inside it)
    seq_len = 20
    ours = _bidirectional_allowed(num_context, seq_len, window, [s for s in spans if s[1] > num_context],
                                  torch.device("cpu"))
    assert torch.equal(ours, hf_mask(num_context, seq_len, window, spans))


def test_layer_routes_span_steps_to_the_torch_backend() -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernels build no bidirectional mask")

    class NoSpans(AttentionBackend):
        """A backend without bidirectional masks (as the Triton one)."""

        name = "no-spans"

        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            refuse()

    layer = Attention(num_heads=2, head_dim=8, scale=0.3, num_kv_heads=1)
    layer.backend = NoSpans()
    layer.kv_cache = torch.zeros(2, 4, 8, 1, 8)
    num_tokens = 6
    q, k, v = (torch.randn(num_tokens, d) for d in (16, 8, 8))

    def metadata(spans):
        return AttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=1, query_start_loc=torch.tensor([0, num_tokens]),
            seq_lens=torch.tensor([num_tokens]), block_table=torch.tensor([[1, 2]], dtype=torch.int32),
            slot_mapping=torch.arange(8, 8 + num_tokens), max_query_len=num_tokens, max_seq_len=num_tokens,
            query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens], block_size=8,
            bidirectional_spans=spans)

    with set_forward_context(metadata({0: [(1, 5)]})):
        out = layer(q, k, v)
    # Position 1 sees 2..4 (its image), position 5 sees everything before it as usual.
    qh, kh, vh = q.view(num_tokens, 2, 8).transpose(0, 1), k.view(1, num_tokens, 8), v.view(1, num_tokens, 8)
    allowed = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    allowed[1:5, 1:5] = True
    scores = (qh @ kh.transpose(1, 2) * 0.3).masked_fill(~allowed, float("-inf"))
    expected = (scores.softmax(-1) @ vh).transpose(0, 1).reshape(num_tokens, 16)
    torch.testing.assert_close(out, expected)
    with set_forward_context(metadata(None)), pytest.raises(AssertionError, match="Triton"):
        layer(q, k, v)
