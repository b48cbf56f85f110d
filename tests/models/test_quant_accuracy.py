"""Quantized inference on the embedded model (SmolLM2 Q4_1 GGUF): perplexity and the engine path.

Perplexity is measured on standard-library docstrings (lm_console/engine/models/quant/perplexity.py) with
every quantized linear on the int8 kernel (the decode path). The bound is the issue's: the
file's own quantized weights ("gguf") and per-channel int8 within 1% of the float32 model
(the file's dequantized weights). benchmarks/perplexity.py gives the figures on 4096 tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lm_console.kernels import cpu_quant

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cpu_quant.load() is None, reason="no quantized CPU kernels")]

NUM_TOKENS, WINDOW = 1024, 512


@pytest.fixture(scope="module")
def embedded():
    from transformers import AutoConfig, AutoTokenizer

    from lm_console.engine.models.embedded import resolve_model_path
    from lm_console.engine.models.quant.perplexity import stdlib_text

    model_dir = resolve_model_path(None)
    ids = AutoTokenizer.from_pretrained(model_dir)(stdlib_text())["input_ids"][:NUM_TOKENS]
    return Path(model_dir), AutoConfig.from_pretrained(model_dir), ids


@pytest.fixture(scope="module")
def fp32_perplexity(embedded):
    from lm_console.engine.models.loader import load_model
    from lm_console.engine.models.quant.perplexity import perplexity

    model_dir, hf_config, ids = embedded
    return perplexity(load_model(model_dir, hf_config, torch.float32, "cpu"), ids, WINDOW)


@pytest.mark.parametrize("method", ["gguf", "int8"])
def test_quantized_perplexity_within_one_percent_of_fp32(embedded, fp32_perplexity, method, monkeypatch):
    from lm_console.engine.models.loader import load_model
    from lm_console.engine.models.quant.perplexity import perplexity

    model_dir, hf_config, ids = embedded
    monkeypatch.setattr(cpu_quant, "DENSE_ROWS", 1 << 30)  # every linear on the int8 kernel
    model = load_model(model_dir, hf_config, torch.bfloat16, "cpu", quantization=method)
    assert model.model.layers[0].mlp.down_proj.quant is not None
    ppl = perplexity(model, ids, WINDOW)
    assert 4 < fp32_perplexity < 30  # the text and model are what this test means them to be
    print(f"{method}: perplexity {ppl:.4f} vs fp32 {fp32_perplexity:.4f}")
    assert ppl / fp32_perplexity - 1 < 0.01, f"{method}: {ppl:.4f} vs fp32 {fp32_perplexity:.4f}"


def test_engine_serves_the_gguf_weights_packed(make_llm):
    """quantization="gguf": the engine runs on the file's packed weights (tied head included)."""
    from lm_console.engine import SamplingParams

    llm = make_llm(None, dtype="bfloat16", quantization="gguf", multiprocess=False, max_model_len=256,
                   max_num_batched_tokens=256)
    assert llm.config.model_config.quantization == "gguf"
    runner = llm.engine_core.engine_core.model_executor.worker.model_runner
    head = runner.model.lm_head
    assert head.quant is not None and head.quant.source == "Q8_0" and head.weight.device.type == "meta"
    # resident weights (packed + what stayed dense) within 1.2x the file's tensor bytes (issue 17)
    from gguf import GGUFReader

    from lm_console.engine.models.embedded import gguf_source

    packed = {id(m.quant): m.quant.nbytes() for m in runner.model.modules() if getattr(m, "quant", None)}
    dense = sum(p.numel() * p.element_size() for p in runner.model.parameters() if p.device.type != "meta")
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(gguf_source(llm.config.model_config.model_dir)).tensors)
    assert sum(packed.values()) + dense <= 1.2 * file_bytes
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
