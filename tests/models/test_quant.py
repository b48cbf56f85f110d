"""GGUF repacking and model quantization (lm_console/engine/models/quant/), and how the method is chosen."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lm_console.engine.config import EngineArgs, engine_args, resolve_quantization
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.kernels import cpu_quant

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from lm_console.engine.models.quant.gguf_repack import pack_rows, unpack_tensor  # noqa: E402

needs_kernels = pytest.mark.skipif(cpu_quant.load() is None, reason="no quantized CPU kernels")


def _unpacked_dense(u) -> np.ndarray:
    d = np.repeat(u.d.astype(np.float64), 32, 1)
    m = np.repeat(u.m.astype(np.float64), 32, 1)
    return u.q * d + m


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_native_formats_unpack_exactly(type_name):
    """Q8_0 / Q4_0 / Q4_1 blocks keep the file's values: d * q + m is gguf's dequantization."""
    x = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    raw = quantize(x, GGMLQuantizationType[type_name])
    ref = dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float64)
    u = unpack_tensor(type_name, raw, 6, 128)
    assert u.fmt == ("b8" if type_name == "Q8_0" else "b4")
    assert np.allclose(_unpacked_dense(u), ref, rtol=0, atol=1e-6 * np.abs(ref).max())


def _random_k_quant(type_name: str, rows: int, cols: int) -> np.ndarray:
    """Valid random super-blocks: random bytes with sane fp16 scales."""
    size = {"Q4_K": 144, "Q6_K": 210}[type_name]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scales = (rng.random((rows, cols // 256, 2)) * 0.01 + 0.001).astype(np.float16).view(np.uint8)
    if type_name == "Q4_K":
        raw[..., :4] = scales.reshape(rows, cols // 256, 4)  # d, dmin lead the block
    else:
        raw[..., -2:] = scales.reshape(rows, cols // 256, 4)[..., :2]  # d ends the block
        raw[..., 192:208] = rng.integers(-40, 40, (rows, cols // 256, 16)).astype(np.int8).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_quants_requantize_within_half_a_step(type_name):
    raw = _random_k_quant(type_name, 4, 512)
    ref = dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float64)
    u = unpack_tensor(type_name, raw, 4, 512)
    assert u.fmt == ("b4" if type_name == "Q4_K" else "b8")
    step = np.repeat(u.d.astype(np.float64), 32, 1)
    # half a step, plus the fp16 rounding of the block's scale and offset
    assert np.all(np.abs(_unpacked_dense(u) - ref) <= step * 0.5 + 2e-3 * np.abs(ref) + 1e-6)


@needs_kernels
def test_mixed_formats_stack_into_b8():
    """A fused linear whose parts differ in format (Q4_1 and Q8_0) packs into one b8 weight."""
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    parts = [unpack_tensor(t, quantize(x, GGMLQuantizationType[t]), 4, 64) for t in ("Q4_1", "Q8_0")]
    qw = pack_rows(parts)
    assert qw.fmt == "b8" and qw.source == "Q4_1+Q8_0"
    ref = np.concatenate([_unpacked_dense(p) for p in parts])
    assert np.allclose(cpu_quant.dequantize(qw).double().numpy(), ref, atol=1e-6)


def test_quantization_argument_is_checked(tmp_path):
    with pytest.raises(InvalidEngineArgsError, match="quantization="):
        EngineArgs(quantization="fp4")._verify()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidEngineArgsError, match="needs a model converted from a GGUF"):
        resolve_quantization("gguf", str(tmp_path), "bfloat16", "cpu")
    with pytest.raises(InvalidEngineArgsError, match="CPU only"):
        resolve_quantization("int8", str(tmp_path), "bfloat16", "cuda")
    assert resolve_quantization(None, str(tmp_path), "bfloat16", "cpu") is None  # not a GGUF
    assert resolve_quantization("int8", str(tmp_path), "float32", "cpu") == "int8"
    assert resolve_quantization("none", str(tmp_path), "bfloat16", "cpu") is None


@needs_kernels
def test_auto_keeps_gguf_weights_in_bf16_on_cpu_only(tmp_path, monkeypatch):
    from lm_console.engine.models.embedded import GGUF_SOURCE_FILE

    fake_gguf = tmp_path / "m.gguf"
    fake_gguf.write_bytes(b"GGUF")
    (tmp_path / GGUF_SOURCE_FILE).write_text(json.dumps({"path": str(fake_gguf)}))
    monkeypatch.delenv("LMC_QUANT_AUTO", raising=False)
    monkeypatch.delenv("LMC_CPU_KERNELS", raising=False)
    monkeypatch.setattr(engine_args, "cpu_has_int8_dot", lambda: True)
    assert resolve_quantization(None, str(tmp_path), "bfloat16", "cpu") == "gguf"  # faster
    assert resolve_quantization("auto", str(tmp_path), "float32", "cpu") is None  # exactness tests
    assert resolve_quantization("gguf", str(tmp_path), "float32", "cpu") == "gguf"
    monkeypatch.setenv("LMC_CPU_KERNELS", "0")  # no kernels: auto stays dense
    assert resolve_quantization(None, str(tmp_path), "bfloat16", "cpu") is None
    monkeypatch.delenv("LMC_CPU_KERNELS")
    monkeypatch.setenv("LMC_QUANT_AUTO", "0")
    assert resolve_quantization(None, str(tmp_path), "bfloat16", "cpu") is None
    monkeypatch.delenv("LMC_QUANT_AUTO")
    assert resolve_quantization(None, str(tmp_path), "bfloat16", "cuda") is None
    monkeypatch.setattr(engine_args, "cpu_has_int8_dot", lambda: False)  # AVX2 only: the portable path is slower
    assert resolve_quantization(None, str(tmp_path), "bfloat16", "cpu") is None
    assert resolve_quantization("gguf", str(tmp_path), "bfloat16", "cpu") == "gguf"  # asked for: kept


@pytest.mark.skipif(cpu_quant.load() is None, reason="no quantized CPU kernels")
def test_packed_weights_share_one_huge_page_allocation(tiny_llama_dir):
    """quantize_model re-homes every packed tensor in one allocation on huge pages (a decode step
    streams them all): contiguous, 2 MiB-aligned on Linux, values unchanged, tied copies shared."""
    import sys

    import torch
    from transformers import AutoConfig

    from lm_console.engine.models.layers import Embedding, Linear
    from lm_console.engine.models.loader import load_model
    from lm_console.engine.models.quant import quantize_model

    model = load_model(tiny_llama_dir, AutoConfig.from_pretrained(tiny_llama_dir), torch.bfloat16,
                       torch.device("cpu"))
    expected = {name: cpu_quant.quantize_int8_per_channel(m.weight) for name, m in model.named_modules()
                if isinstance(m, (Linear, Embedding))}
    quantize_model(model, "int8")
    quants = {name: m.quant for name, m in model.named_modules() if isinstance(m, (Linear, Embedding))}
    assert quants.keys() == expected.keys()
    for name, q in quants.items():
        assert torch.equal(q.qweight, expected[name].qweight) and torch.equal(q.scales, expected[name].scales)
    if model.lm_head.weight is model.model.embed_tokens.weight or getattr(model, "tie_word_embeddings", False):
        assert quants["lm_head"] is quants["model.embed_tokens"]
    unique = {id(q): q for q in quants.values()}.values()
    tensors = [t for q in unique for t in (q.qweight, q.scales, q.offsets) if t is not None]
    starts = sorted(t.data_ptr() for t in tensors)
    span = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors) - starts[0]
    assert all(p % 64 == 0 for p in starts)
    assert span <= sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)  # one packed arena
    if sys.platform.startswith("linux"):
        assert starts[0] % (1 << 21) == 0  # the arena starts on a huge page
