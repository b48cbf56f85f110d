"""End to end on a GPU, for benchmarks/gpu_check.sh.

1. exact: a tiny random Qwen3-style model (float32) generates the same greedy tokens through
   the torch backend, the Triton backend eager, and the Triton backend with CUDA graphs.
2. graphs / eager: nano-vllm's benchmark workload (256 requests, prompt and output lengths
   uniform in [100, 1024], random token ids, temperature 0.6, ignore_eos; the same `random`
   draws as nano-vllm's bench.py) on a Qwen3-0.6B-shaped random-weight model (bf16), with
   CUDA graphs on and off; output tokens/s. KV cache sized by profiling (gpu_memory_utilization).

    python benchmarks/gpu_e2e.py --out DIR [--budget-s 300]   # all parts, one process each
    python benchmarks/gpu_e2e.py --out DIR --only exact|graphs|eager [--deadline-s 100]
    python benchmarks/gpu_e2e.py --out DIR --smoke      # CPU, tiny sizes: checks the script

No tokenizer or weights can be downloaded: the models get random weights and a synthetic
word-level tokenizer of the right vocabulary size. Each part writes DIR/e2e_<part>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORK = Path(os.environ.get("LMC_GPU_CHECK_DIR", "/tmp/lmc_gpu_check"))

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY_QWEN3 = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True)


def save_synthetic_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id ("<t17>"), saved in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<t0>",
                                   bos_token="<t1>", eos_token="<t2>", pad_token="<t2>")
    fast.save_pretrained(path)


def build_model_dir(path: Path, fields: dict[str, Any], dtype: str, spread: bool) -> Path:
    """Random-weight Qwen3 checkpoint + tokenizer in `path` (reused if already there)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(bos_token_id=1, eos_token_id=2, pad_token_id=2, attention_bias=False,
                         **fields)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if spread:  # O(1) activations and well-separated logits: greedy ties are rare
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=gen, device=device, dtype=param.dtype)
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.1 * noise)
                elif "embed_tokens" in name:
                    param.copy_(noise)
                else:
                    param.copy_(noise / param.shape[-1] ** 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_synthetic_tokenizer(path, fields["vocab_size"])
    return path


def _import_engine() -> tuple[Any, Any]:
    """LLM and SamplingParams, with transformers imported first: LLM() imports tokenizer
    modules in a thread while an in-process engine imports AutoConfig, which can race."""
    from transformers import AutoConfig, PreTrainedTokenizerFast  # noqa: F401

    from lm_console.engine.frontend.tokenizer import preload_tokenizer_modules

    preload_tokenizer_modules()

    from lm_console.engine import LLM, SamplingParams

    return LLM, SamplingParams


def run_exact(out: Path, smoke: bool) -> dict[str, Any]:
    """Greedy tokens: torch backend vs Triton eager vs Triton + CUDA graphs (float32)."""
    LLM, SamplingParams = _import_engine()

    model_dir = build_model_dir(WORK / "tiny_qwen3", TINY_QWEN3, "float32", spread=True)
    rng = random.Random(1)
    num_prompts, max_tokens = (3, 4) if smoke else (12, 24)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(rng.randint(5, 300))]}
               for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    device = "cpu" if smoke else "cuda"
    variants = {"torch": dict(attention_backend="torch"),
                "triton_eager": dict(attention_backend="triton", enforce_eager=True),
                "triton_graphs": dict(attention_backend="triton", enforce_eager=False)}
    if smoke:
        variants = {"torch": variants["torch"]}
    tokens: dict[str, list[list[int]]] = {}
    for name, extra in variants.items():
        llm = LLM(str(model_dir), dtype="float32", device=device, max_model_len=1024,
                  max_num_seqs=16, max_num_batched_tokens=256, num_gpu_blocks_override=2048,
                  multiprocess=False, **extra)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[name] = [list(o.outputs[0].token_ids) for o in outputs]
        llm.shutdown()
    reference = tokens["torch"]
    total = sum(len(t) for t in reference)
    result: dict[str, Any] = {"num_prompts": num_prompts, "tokens_per_prompt": max_tokens}
    for name, got in tokens.items():
        same = sum(a == b for ref, seq in zip(reference, got) for a, b in zip(ref, seq))
        result[f"{name}_matching_tokens"] = f"{same}/{total}"
        result[f"{name}_identical"] = got == reference
    return result


def nano_vllm_workload(num_seqs: int, max_len: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm bench.py's draws: seed(0), prompts of randint(100, max_len) ids in [0, 10000],
    then max_tokens = randint(100, max_len) per request."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_len))]
               for _ in range(num_seqs)]
    max_tokens = [random.randint(100, max_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def run_throughput(out: Path, enforce_eager: bool, deadline_s: float, smoke: bool) -> dict:
    """nano-vllm's workload; stops at the deadline and reports the partial rate if it must."""
    LLM, SamplingParams = _import_engine()

    fields = TINY_QWEN3 if smoke else QWEN3_0_6B
    dtype = "float32" if smoke else "bfloat16"
    model_dir = build_model_dir(WORK / ("smoke_0p6b" if smoke else "qwen3_0p6b"), fields, dtype,
                                spread=False)
    num_seqs, max_len = (4, 110) if smoke else (256, 1024)
    prompts, max_tokens = nano_vllm_workload(num_seqs, max_len)
    prompts = [[t % fields["vocab_size"] for t in p] for p in prompts]  # (a no-op at full size)
    start = time.perf_counter()
    llm = LLM(str(model_dir), dtype=dtype, device="cpu" if smoke else "cuda", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192, enforce_eager=enforce_eager,
              multiprocess=False, log_stats=False)
    startup_s = time.perf_counter() - start
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    counted = [0]
    process = llm.output_processor.process_outputs

    def counting(engine_outputs: Any) -> Any:  # tokens produced so far, for a partial rate
        counted[0] += sum(len(o.new_token_ids) for o in engine_outputs.outputs)
        return process(engine_outputs)

    llm.output_processor.process_outputs = counting
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.alarm(max(int(deadline_s - startup_s), 1))
    begin = time.perf_counter()
    partial = False
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        signal.alarm(0)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert generated == sum(max_tokens), (generated, sum(max_tokens))
    except TimeoutError:
        partial, generated = True, counted[0]
    elapsed = time.perf_counter() - begin
    return dict(cuda_graphs=not enforce_eager, num_requests=num_seqs,
                output_tokens=generated, prompt_tokens=sum(map(len, prompts)),
                seconds=elapsed, output_tok_s=generated / elapsed, partial=partial,
                startup_s=startup_s, num_kv_blocks=llm.config.cache_config.num_blocks)


def _raise_timeout(signum: int, frame: Any) -> None:
    raise TimeoutError("throughput run past its deadline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", choices=["exact", "graphs", "eager"])
    parser.add_argument("--budget-s", type=float, default=300.0, help="all parts together")
    parser.add_argument("--deadline-s", type=float, default=100.0,
                        help="one throughput run: start-up plus generation")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only is None:  # each part in its own process: a clean device, a crash stays local
        end = time.monotonic() + args.budget_s
        parts = ["exact", "graphs", "eager"]
        for i, part in enumerate(parts):
            left = end - time.monotonic()
            timeout = min(90.0, 0.25 * left) if part == "exact" else left / (len(parts) - i)
            # The child's own deadline leaves room for imports, building the model, the report.
            cmd = [sys.executable, __file__, "--out", str(args.out), "--only", part,
                   "--deadline-s", str(max(timeout - 45, 10))] + (["--smoke"] * args.smoke)
            try:
                code = subprocess.call(cmd, timeout=max(timeout, 10))
            except subprocess.TimeoutExpired:
                code = "timeout"
            if code:
                print(f"[gpu_e2e] part {part} failed: {code}", flush=True)
        return
    if args.only == "exact":
        result = run_exact(args.out, args.smoke)
    else:
        result = run_throughput(args.out, args.only == "eager", args.deadline_s, args.smoke)
    (args.out / f"e2e_{args.only}.json").write_text(json.dumps(result, indent=1))
    print(f"[gpu_e2e] {args.only}: {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
