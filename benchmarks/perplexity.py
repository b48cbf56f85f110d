"""Perplexity of each weight format against the float32 model, on standard-library docstrings.

    PYTHONPATH=. python benchmarks/perplexity.py [--model PATH_OR_NAME] [--tokens 4096]

Variants (all from the same model, loaded in one process):
  fp32   the dense float32 model (for a GGUF file: its dequantized weights, "the file's precision")
  bf16   dense bf16
  gguf   the file's own quantized weights (Q4_1 / Q8_0 for the embedded model), int8 activations
  int8   per-channel int8 weights, int8 activations per block of 32 (quantization="int8")
  q8_0 / q4_0 / q4_1   the dense weights requantized to that GGUF block format (int8 activations);
         for a model that came from a Q4 file, q4_* quantize its weights twice (not in the default list)
  gguf+kv-bf16 / gguf+kv-int8   the file's weights through the running engine (LLM, prompt
         logprobs of each window), its paged KV cache in bf16 or int8 (kv_cache_dtype; int8 is the
         default where the weights run quantized): what a served request's tokens see
  llamacpp   llama.cpp (llama-cpp-python, the optional [bench] extra) on the same GGUF file, the
         same token ids and windows: the reference the Q4 formats are held to (skipped when
         llama-cpp-python is not installed)

The quantized variants run every linear through the int8 kernel (the decode path), not the
dequantize-to-bf16 prefill path, so the figures are those of generated tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from lm_console.engine.models.embedded import gguf_source, resolve_model_path
from lm_console.engine.models.layers import Embedding, Linear
from lm_console.engine.models.loader import load_model
from lm_console.engine.models.quant import _drop_dense
from lm_console.engine.models.quant.perplexity import perplexity, stdlib_text, window_perplexity
from lm_console.kernels import cpu_quant

VARIANTS = ("fp32", "bf16", "gguf", "int8", "q8_0", "q4_0", "q4_1", "gguf+kv-bf16", "gguf+kv-int8", "llamacpp")
ENGINE_VARIANTS = {"gguf+kv-bf16": "bfloat16", "gguf+kv-int8": "int8"}  # -> kv_cache_dtype


def llamacpp_perplexity(gguf: Path, token_ids: list[int], window: int, threads: int = 2) -> float:
    """exp(mean NLL) from llama.cpp's logits, in engine.models.quant.perplexity's windows."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=window, n_batch=window, n_ubatch=window,
                n_threads=threads, logits_all=True, verbose=False)

    def logits_of(ids: torch.Tensor) -> torch.Tensor:
        llm.reset()
        llm.eval(ids.tolist())
        return torch.from_numpy(np.asarray(llm.scores[: ids.numel() - 1], dtype=np.float64))

    return window_perplexity(token_ids, window, logits_of)


def engine_perplexity(model: str | None, token_ids: list[int], window: int, kv_cache_dtype: str) -> float:
    """exp(mean NLL) of window_perplexity's windows, each a request to an engine (in this process,
    the GGUF file's weights) whose prompt logprobs give every token's log-likelihood: the K/V
    come back from its paged cache as the decode steps of a served request would read them."""
    from lm_console.engine import LLM, SamplingParams

    llm = LLM(model, quantization="gguf", kv_cache_dtype=kv_cache_dtype, multiprocess=False,
              enable_prefix_caching=False, max_model_len=window + 1, max_num_batched_tokens=max(window + 1, 2048))
    try:
        windows = [token_ids[start : start + window] for start in range(0, len(token_ids) - 1, window)]
        windows = [ids for ids in windows if len(ids) >= 2]
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in windows],
                               SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
        total, count = 0.0, 0
        for ids, output in zip(windows, outputs):
            for position, logprobs in enumerate(output.prompt_logprobs[1:], start=1):
                total -= logprobs[ids[position]].logprob
                count += 1
    finally:
        llm.shutdown()
    return math.exp(total / count)


def requantize_model(model: torch.nn.Module, type_name: str) -> None:
    """Quantize every linear / embedding's dense weight to a GGUF block type (in memory)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from lm_console.engine.models.quant.gguf_repack import pack_rows, unpack_tensor

    packed: dict[int, cpu_quant.QuantWeight] = {}
    for module in model.modules():
        if isinstance(module, (Linear, Embedding)) and module.weight.device.type != "meta":
            key = id(module.weight)
            if key not in packed:
                w = module.weight.detach().float().numpy()
                raw = quantize(w, GGMLQuantizationType[type_name.upper()])
                packed[key] = pack_rows([unpack_tensor(type_name.upper(), raw, *w.shape)])
            module.set_quant_weight(packed[key])
    for module in model.modules():
        if isinstance(module, (Linear, Embedding)) and module.quant is not None:
            _drop_dense(module)


def load_variant(model_dir: Path, hf_config, variant: str) -> torch.nn.Module:
    """The model in one of VARIANTS."""
    if variant == "fp32":
        return load_model(model_dir, hf_config, torch.float32, "cpu")
    if variant == "bf16":
        return load_model(model_dir, hf_config, torch.bfloat16, "cpu", quantization=None)
    if variant in ("gguf", "int8"):
        return load_model(model_dir, hf_config, torch.bfloat16, "cpu", quantization=variant)
    model = load_model(model_dir, hf_config, torch.bfloat16, "cpu")
    requantize_model(model, variant)
    return model


def run(model: str | None, num_tokens: int, window: int, variants: tuple[str, ...]) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    model_dir = resolve_model_path(model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(stdlib_text())["input_ids"][:num_tokens]
    if gguf_source(model_dir) is None:
        variants = tuple(v for v in variants if v not in ("gguf", "llamacpp", *ENGINE_VARIANTS))
    if "llamacpp" in variants:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python is not installed: skipping the llamacpp variant")
            variants = tuple(v for v in variants if v != "llamacpp")
    cpu_quant.DENSE_ROWS = 1 << 30  # every quantized linear on the int8 kernel
    results = {}
    for variant in variants:
        start = time.perf_counter()
        if variant == "llamacpp":
            ppl = llamacpp_perplexity(gguf_source(model_dir), ids, window)
        elif variant in ENGINE_VARIANTS:
            ppl = engine_perplexity(model, ids, window, ENGINE_VARIANTS[variant])
        else:
            ppl = perplexity(load_variant(model_dir, hf_config, variant), ids, window)
        results[variant] = {"perplexity": ppl, "seconds": time.perf_counter() - start}
    base = results["fp32"]["perplexity"]
    for result in results.values():
        result["vs_fp32"] = result["perplexity"] / base - 1.0
    return {"model": str(model_dir), "tokens": len(ids), "window": window, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--variants", default="fp32,bf16,gguf,int8,q8_0,gguf+kv-bf16,gguf+kv-int8,llamacpp")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args.model, args.tokens, args.window, tuple(args.variants.split(",")))
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{report['tokens']} tokens of standard-library docstrings, windows of {report['window']}")
    print(f"{'variant':13} {'perplexity':>11} {'vs fp32':>9}")
    for name, r in report["results"].items():
        print(f"{name:13} {r['perplexity']:11.4f} {100 * r['vs_fp32']:+8.2f}%")


if __name__ == "__main__":
    main()
