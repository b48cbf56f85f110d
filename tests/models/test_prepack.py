"""oneDNN weight prepacking (lm_console/engine/models/prepack.py): same results as F.linear, bf16 CPU only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from lm_console.engine.models.layers import Linear
from lm_console.engine.models.loader import load_model
from lm_console.engine.models import prepack
from lm_console.engine.models.prepack import prepack_available, prepack_linears

needs_prepack = pytest.mark.skipif(not prepack_available(torch.bfloat16, torch.device("cpu")),
                                   reason="this torch or CPU has no oneDNN bf16 weight prepacking (AVX2 only)")


@needs_prepack
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(bias):
    torch.manual_seed(0)
    linear = Linear(96, 200, bias, torch.bfloat16)
    linear.weight.copy_(torch.randn(200, 96))
    if bias:
        linear.bias.copy_(torch.randn(200))
    assert prepack_linears(linear) == 1 and linear.packed_weight is not None
    inputs = [torch.randn(rows, 96).to(torch.bfloat16) for rows in (0, 1, 7, 33, 300)]
    inputs += [torch.randn(2, 5, 96).to(torch.bfloat16),  # a leading batch axis
               torch.randn(9, 192).to(torch.bfloat16)[:, ::2]]  # a strided view
    for x in inputs:
        assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias)), tuple(x.shape)


def test_only_bf16_cpu_weights_are_packed(monkeypatch):
    fp32 = Linear(8, 8, False, torch.float32)
    assert prepack_linears(fp32) == 0 and fp32.packed_weight is None
    monkeypatch.setenv("LMC_ONEDNN_PREPACK", "0")
    bf16 = Linear(8, 8, False, torch.bfloat16)
    assert prepack_linears(bf16) == 0 and bf16.packed_weight is None


@needs_prepack
def test_a_loaded_bf16_model_is_packed_and_unchanged(tiny_llama_dir: Path, monkeypatch):
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    packed = load_model(tiny_llama_dir, config, torch.bfloat16, "cpu")
    monkeypatch.setenv("LMC_ONEDNN_PREPACK", "0")
    plain = load_model(tiny_llama_dir, config, torch.bfloat16, "cpu")
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert all(m.packed_weight is None for m in plain.modules() if isinstance(m, Linear))
    plain_linears = [m for m in plain.modules() if isinstance(m, Linear)]
    generator = torch.Generator().manual_seed(0)
    for a, b in zip(linears, plain_linears):
        x = torch.randn(11, a.weight.shape[1], generator=generator).to(torch.bfloat16)
        assert torch.equal(a(x), b(x))


def test_a_cpu_whose_onednn_cannot_pack_bf16_keeps_f_linear(monkeypatch):
    # An AVX2-only CPU: oneDNN's bf16 reorder raises; the probe says so once and nothing is packed.
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    prepack.onednn_packs_bf16.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    try:
        assert not prepack_available(torch.bfloat16, torch.device("cpu"))
        linear = Linear(8, 8, False, torch.bfloat16)
        linear.weight.copy_(torch.randn(8, 8))
        assert prepack_linears(linear) == 0 and linear.packed_weight is None
        x = torch.randn(3, 8).to(torch.bfloat16)
        assert torch.equal(linear(x), F.linear(x, linear.weight))
    finally:
        prepack.onednn_packs_bf16.cache_clear()
