"""Speculative decoding (ngram, suffix) against plain decoding, and llama.cpp's prompt lookup.

Two workloads, greedy, on the embedded model (the default LLM(): GGUF weights, the C decode stack):
- copy: a chat turn (the model's own chat template) asking to repeat a passage of about 130
  tokens word for word; the answer copies its prompt, which is what model-free proposers reward.
  The prompts go in as token ids, the same ids to llama.cpp;
- random: prompts of random token ids (ignore_eos); nothing to copy, so proposals are rare and
  mostly rejected: this measures what speculation costs when it does not help.
Each workload runs as a single stream (one request at a time) and batched (--width requests at
once, max_num_seqs = width). For every run: wall output tok/s, CPU seconds per output token of
this process (the engine core runs in it: multiprocess=False), acceptance counters, and whether
the greedy outputs equal the plain run's. With llama-cpp-python installed, llama.cpp's single
stream on the same GGUF file, plain and with LlamaPromptLookupDecoding, joins the report.

    python benchmarks/spec_decode.py [--width 32] [--single-tokens 96] [--batched-tokens 48]
        [--num-speculative-tokens 4] [--rounds 3] [--skip batched,llamacpp] [--save-result out.json]

Each variant runs --rounds times, the order rotated per round; figures are the medians. The JSON
goes to the benchmark history with the machine's fingerprint (_record.py).

The development machine is shared (other jobs take cores at random): the report records the load
average before each run; compare ratios within one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _record import record  # noqa: E402

PASSAGE = (
    "The history of computing is a story of abstractions stacked on one another. Early machines were "
    "programmed by rewiring panels; later, stored programs let the same hardware solve many problems. "
    "Compilers translated readable languages into machine code, operating systems shared one processor "
    "among many users, and networks joined distant computers into one fabric. Each layer hid the details "
    "of the one below it, so that engineers could think about the problem in front of them. Gardens teach "
    "a similar lesson. A gardener plans the beds, waters them at dawn, pulls weeds before they go to seed, "
    "and keeps a notebook of what grew where. Over the years the notebook becomes more valuable than any "
    "single harvest, because it records what worked and what failed. Cities, too, are layered systems: "
    "pipes under streets, streets under traffic rules, rules under the habits of the people who live there."
)


def copy_prompts(n: int, tokenizer: Any) -> list[list[int]]:
    """n copy-friendly prompts as token ids: a chat turn asking to repeat a window of PASSAGE.

    A chat turn, not a bare completion prompt: the embedded model is an instruct model, and
    without its template it wanders off into a quiz for half of the windows instead of copying.
    """
    words = PASSAGE.split()
    prompts = []
    for i in range(n):
        start = (i * 17) % 40
        text = " ".join(words[start:start + 110])
        messages = [{"role": "user", "content": f"Repeat the following text exactly, word for word.\n\n{text}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def random_prompts(n: int, vocab: int, length: int = 64, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_lmc(spec: dict[str, Any] | None, prompts: list, max_tokens: int, width: int, random_ids: bool,
            threads: int | None) -> dict[str, Any]:
    from lm_console.engine import LLM, SamplingParams

    llm = LLM(multiprocess=False, max_num_seqs=max(width, 1), speculative_config=spec, num_threads=threads)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=random_ids)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    load_before = os.getloadavg()[0]
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    outputs = []
    if width == 1:
        for item in inputs:
            outputs += llm.generate([item], params, use_tqdm=False)
    else:
        outputs = llm.generate(inputs, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall0, _cpu_seconds() - cpu0
    stats = llm.engine_core.engine_core.scheduler.spec_decoding_stats
    llm.shutdown()
    token_ids = [o.outputs[0].token_ids for o in outputs]
    num_tokens = sum(len(t) for t in token_ids)
    result: dict[str, Any] = {
        "speculative_config": spec, "requests": len(inputs), "width": width, "output_tokens": num_tokens,
        "wall_s": wall, "output_tok_s": num_tokens / wall, "cpu_ms_per_token": 1e3 * cpu / num_tokens,
        "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0], "token_ids": token_ids}
    if stats is not None:
        result.update(num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
                      num_accepted_tokens=stats.num_accepted_tokens,
                      acceptance_rate=stats.acceptance_rate, mean_acceptance_length=stats.mean_acceptance_length)
    return result


def run_llamacpp(gguf: Path, prompts: list[list[int]], max_tokens: int, threads: int,
                 lookup: bool) -> dict[str, Any] | None:
    """llama.cpp single stream, greedy, on the same GGUF; with lookup: LlamaPromptLookupDecoding."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    draft = LlamaPromptLookupDecoding(num_pred_tokens=4) if lookup else None
    llm = Llama(model_path=str(gguf), n_ctx=1024, n_batch=512, n_threads=threads, verbose=False,
                draft_model=draft)

    def generate(prompt: list[int], n: int) -> list[int]:
        out = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(token)
            if len(out) >= n:
                break
        return out

    generate(prompts[0][:16], 4)
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    token_ids = [generate(p, max_tokens) for p in prompts]
    wall, cpu = time.perf_counter() - wall0, _cpu_seconds() - cpu0
    llm.close()
    num_tokens = sum(len(t) for t in token_ids)
    return {"prompt_lookup": lookup, "output_tokens": num_tokens, "wall_s": wall, "output_tok_s": num_tokens / wall,
            "cpu_ms_per_token": 1e3 * cpu / num_tokens, "token_ids": token_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=32, help="requests at once in the batched runs")
    parser.add_argument("--single-requests", type=int, default=3)
    parser.add_argument("--single-tokens", type=int, default=96)
    parser.add_argument("--batched-tokens", type=int, default=48)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    parser.add_argument("--skip", default="", help="comma list of: single,batched,copy,random,llamacpp")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of every variant, in a rotated order per round; figures are medians")
    parser.add_argument("--save-result", default=None)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    from lm_console.engine.models.embedded import DEFAULT_MODEL, _EMBEDDED, _embedded_gguf_path

    k = args.num_speculative_tokens
    variants: list[tuple[str, dict[str, Any] | None]] = [
        ("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": k}),
        ("suffix", {"method": "suffix", "num_speculative_tokens": k})]
    # The machine itself (CPU, ISA, commit, load) is in the fingerprint record() stamps on the report.
    report: dict[str, Any] = {"model": DEFAULT_MODEL, "loadavg_start": os.getloadavg(), "runs": {}}
    workloads = {"copy": (copy_prompts, False), "random": (None, True)}
    from transformers import AutoConfig, AutoTokenizer

    from lm_console.engine.models.embedded import resolve_model_path

    vocab = AutoConfig.from_pretrained(resolve_model_path(None)).vocab_size
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    for workload, (make, random_ids) in workloads.items():
        if workload in skip:
            continue
        for mode, width, requests, tokens in (("single", 1, args.single_requests, args.single_tokens),
                                              ("batched", args.width, args.width, args.batched_tokens)):
            if mode in skip:
                continue
            prompts = random_prompts(requests, vocab) if random_ids else make(requests, tokenizer)  # type: ignore[misc]
            # Each round runs the variants in a rotated order, so a drift of the machine's load
            # over the run does not favour whichever variant always runs last.
            runs_of: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
            ids_of: dict[str, list] = {}
            for round_index in range(args.rounds):
                shift = round_index % len(variants)
                for name, spec in variants[shift:] + variants[:shift]:
                    result = run_lmc(spec, prompts, tokens, width, random_ids, args.threads)
                    ids = result.pop("token_ids")
                    result["greedy_equal_to_first_run"] = ids_of.setdefault(name, ids) == ids
                    runs_of[name].append(result)
            for name, results in runs_of.items():
                result = dict(results[0])
                for field in ("output_tok_s", "cpu_ms_per_token", "wall_s"):
                    result[field] = statistics.median(r[field] for r in results)
                result["rounds"] = [{f: r[f] for f in ("output_tok_s", "cpu_ms_per_token", "loadavg_1m_before")}
                                    for r in results]
                result["greedy_equal_to_plain"] = ids_of[name] == ids_of["plain"] and all(
                    r.pop("greedy_equal_to_first_run") for r in results)
                result.pop("greedy_equal_to_first_run", None)
                key = f"{workload}/{mode}/{name}"
                report["runs"][key] = result
                print(key, json.dumps({k2: (round(v, 3) if isinstance(v, float) else v)
                                       for k2, v in result.items() if k2 != "rounds"}), flush=True)
    if "llamacpp" not in skip and "copy" not in skip:
        prompts = copy_prompts(args.single_requests, tokenizer)
        gguf = _embedded_gguf_path(_EMBEDDED[DEFAULT_MODEL])
        try:
            from _llamacpp import prepare

            report["llamacpp_note"] = prepare(gguf)
        except ImportError:
            pass  # run_llamacpp says so
        for lookup in (False, True):
            result = run_llamacpp(gguf, prompts, args.single_tokens, args.threads or os.cpu_count() or 1, lookup)
            if result is None:
                report["llamacpp"] = "llama-cpp-python is not installed"
                break
            result.pop("token_ids")
            report.setdefault("llamacpp", {})["prompt_lookup" if lookup else "plain"] = result
            print("llama.cpp", "prompt_lookup" if lookup else "plain", json.dumps(result), flush=True)
    runs = report["runs"]
    summary = {}
    for workload in ("copy", "random"):
        for mode in ("single", "batched"):
            plain = runs.get(f"{workload}/{mode}/plain")
            for name in ("ngram", "suffix"):
                run = runs.get(f"{workload}/{mode}/{name}")
                if plain and run:
                    summary[f"{workload}/{mode}/{name}"] = {
                        "wall_speedup": run["output_tok_s"] / plain["output_tok_s"],
                        "cpu_per_token_ratio": run["cpu_ms_per_token"] / plain["cpu_ms_per_token"]}
    llamacpp = report.get("llamacpp")
    if isinstance(llamacpp, dict) and "plain" in llamacpp:
        for name in ("plain", "ngram", "suffix"):
            run = runs.get(f"copy/single/{name}")
            if run:
                summary[f"copy/single/{name}_vs_llamacpp"] = {
                    "plain": run["output_tok_s"] / llamacpp["plain"]["output_tok_s"],
                    **({"prompt_lookup": run["output_tok_s"] / llamacpp["prompt_lookup"]["output_tok_s"]}
                       if "prompt_lookup" in llamacpp else {})}
    report["summary"] = summary
    report["loadavg_end"] = os.getloadavg()
    for key, value in summary.items():
        print(key, json.dumps({k2: round(v, 3) for k2, v in value.items()}))
    record("spec_decode", report, args.save_result)


if __name__ == "__main__":
    main()
