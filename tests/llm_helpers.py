"""Shared helpers for end-to-end tests: the HF reference and the near-tie comparison rule."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

_TEXT = (
    "The history of computing is a story of abstractions stacked on one another. Early machines "
    "were programmed by rewiring panels; later, stored programs let the same hardware solve many "
    "problems. Compilers translated readable languages into machine code, operating systems "
    "shared one processor among many users, and networks joined distant computers into one "
    "fabric. Each layer hid the details of the one below it, so that engineers could think about "
    "the problem in front of them. Large language models are the newest layer: they turn text "
    "into predictions of more text, one token at a time. Serving them well is a systems problem. "
    "Memory for the attention cache is precious, requests arrive at random times with prompts of "
    "every length, and users expect the first word quickly and the rest at a steady pace. A good "
    "serving engine batches requests continuously, shares the cached prefixes of prompts, splits "
    "long prompts into chunks, and gives memory back the moment a request is done. It measures "
    "everything, because what is not measured cannot be improved. The best engines are also "
    "readable: a newcomer can open the scheduler, follow one request from arrival to its last "
    "token, and understand every decision made along the way. Gardens teach a similar lesson. "
    "A gardener plans the beds, waters them at dawn, pulls weeds before they seed, and keeps a "
    "notebook of what grew where. Over years the notebook becomes more valuable than any single "
    "harvest, because it records what worked and what failed. Cities, too, are layered systems: "
    "pipes under streets, streets under traffic rules, rules under the habits of the people who "
    "live there. When one layer fails, the others must absorb the shock, and the city's "
    "resilience depends on how gracefully each layer degrades."
)


def text_prompts(tokenizer, num_prompts: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Real-text prompts of lengths spread over [min_len, max_len] tokens."""
    ids = tokenizer.encode(_TEXT, add_special_tokens=False)
    while len(ids) < max_len + 64:
        ids = ids + ids
    rng = random.Random(seed)
    lengths = [min_len + (max_len - min_len) * i // max(num_prompts - 1, 1) for i in range(num_prompts)]
    prompts = []
    for length in lengths:
        start = rng.randrange(0, 64)
        prompts.append(ids[start:start + length])
    return prompts


def random_prompts(vocab_size: int, num_prompts: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [min_len + (max_len - min_len) * i // max(num_prompts - 1, 1) for i in range(num_prompts)]
    rng.shuffle(lengths)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


# A near tie: at the first difference, the reference's (fp32) logit of its own token exceeds its
# logit of ours by at most this much. Our fp32 path and HF's differ by ~1e-5 in a logit; a gap of
# 0.01 is far below the spread of a sensitive tiny model's logits (several units).
NEAR_TIE_GAP = 0.01


@dataclass
class Reference:
    token_ids: list[int]
    top5: list[dict[int, float]]  # per generated position: the top-5 token ids and their fp32 logits


def _top5(row: torch.Tensor) -> dict[int, float]:
    values, ids = torch.topk(row.float(), 5)
    return dict(zip(ids.tolist(), values.tolist()))


def _hf_model(model_dir):  # noqa: ANN001, ANN202
    """The HF reference: float32, eager attention (op for op what our float32 path computes)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[Reference]:
    """HF transformers greedy generation, one prompt at a time (no padding), EOS ignored."""
    model = _hf_model(model_dir)
    model.generation_config.eos_token_id = None
    references = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True, eos_token_id=None)
            tokens = out.sequences[0, len(prompt):].tolist()
            references.append(Reference(tokens, [_top5(step[0]) for step in out.logits]))
    return references


def hf_teacher_forced(model_dir, prompts: list[list[int]], completions: list[list[int]]) -> list[Reference]:
    """HF's greedy choices along our completions, one forward a prompt (prompt + completion):
    position p's argmax and top 5 given the prompt and our first p tokens. Up to the first
    difference that is exactly what HF's own greedy generate sees, and compare_greedy looks no
    further, so this checks the same thing as hf_greedy in one forward instead of one a token
    (HF's eager generate takes ~80 ms a token on an AVX2-only CPU)."""
    model = _hf_model(model_dir)
    references = []
    with torch.inference_mode():
        for prompt, completion in zip(prompts, completions):
            logits = model(torch.tensor([prompt + completion[:-1]])).logits[0, len(prompt) - 1:].float()
            references.append(Reference(logits.argmax(-1).tolist(), [_top5(row) for row in logits]))
    return references


def compare_greedy(outputs, references: list[Reference]) -> tuple[int, list[str]]:
    """vLLM's check_logprobs_close rule, tightened: exact match, or at the first difference each
    side's token is in the other's top-5 AND the reference's fp32 logits of the two tokens are
    within NEAR_TIE_GAP (a near tie), after which the prompt is not checked further. Callers also
    require a stated minimum of exact matches. Returns (number of exact matches, failures)."""
    exact = 0
    failures = []
    for i, (output, ref) in enumerate(zip(outputs, references)):
        completion = output.outputs[0]
        ours = completion.token_ids
        if ours == ref.token_ids:
            exact += 1
            continue
        pos = next(p for p in range(min(len(ours), len(ref.token_ids)) + 1)
                   if p >= len(ours) or p >= len(ref.token_ids) or ours[p] != ref.token_ids[p])
        if pos >= len(ours) or pos >= len(ref.token_ids):
            failures.append(f"prompt {i}: lengths differ ({len(ours)} vs {len(ref.token_ids)})")
            continue
        our_top = set(completion.logprobs[pos]) if completion.logprobs else set()
        top = ref.top5[pos]
        gap = top[ref.token_ids[pos]] - top[ours[pos]] if ours[pos] in top else float("inf")
        if ref.token_ids[pos] in our_top and gap <= NEAR_TIE_GAP:
            continue
        failures.append(f"prompt {i}: token {pos} differs ({ours[pos]} vs HF {ref.token_ids[pos]}), "
                        f"not a near tie (fp32 logit gap {gap:.4g} > {NEAR_TIE_GAP})")
    return exact, failures


def assert_no_leaked_blocks(llm) -> None:
    """Every KV block except the null block is free (possibly still cached) once idle.

    A utility call, so it works with the core in-process and in its own process (LLM or
    AsyncLLM: pass `await llm.get_block_pool_state()` for the latter).
    """
    from lm_console.engine.metrics.stats import BlockPoolState

    state = llm if isinstance(llm, BlockPoolState) else llm.get_block_pool_state()
    assert state.num_running_reqs == 0 and state.num_waiting_reqs == 0, "requests left in the engine"
    assert state.num_free_blocks == state.num_blocks - 1, "KV blocks leaked"


def greedy_token_ids(llm, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    """Each token-id prompt's greedy continuation (ignore_eos, max_tokens tokens), in order."""
    from lm_console.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def prefix_sharing_prompts(vocab_size: int, num_tails: int) -> list[list[int]]:
    """num_tails prompts behind one 100-token prefix (prefix-cache hits), then 4 unrelated ones."""
    prefix = random_prompts(vocab_size, 1, 100, 100, seed=7)[0]
    tails = random_prompts(vocab_size, num_tails, 3, 90, seed=8)
    return [prefix + tail for tail in tails] + random_prompts(vocab_size, 4, 20, 200, seed=9)


def sigkill_during_generate(llm, started, pid, num_requests: int = 4, max_tokens: int = 200,
                            join_s: float = 10.0) -> tuple[BaseException, float]:
    """Run `llm.generate` of `num_requests` long requests on a thread; once `started()` holds
    (bounded), SIGKILL `pid` (an int, or a callable giving it then). Returns the error the caller
    got and the seconds from the kill to it; fails when the caller got none."""
    import os
    import signal
    import threading
    import time

    from lm_console.engine import SamplingParams

    errors: list[BaseException] = []
    caught_at: list[float] = []

    def generate() -> None:
        try:
            llm.generate(["long"] * num_requests, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            caught_at.append(time.monotonic())
            errors.append(error)

    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 60
    while not started():
        assert thread.is_alive() and time.monotonic() < deadline, "the requests never started"
        time.sleep(0.01)
    os.kill(pid() if callable(pid) else pid, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(join_s)
    assert not thread.is_alive() and errors, "the caller got no error"
    return errors[0], caught_at[0] - killed


def assert_all_equal(ours: list, reference: list, what: str = "outputs") -> int:
    """The exact-equality families (TP, DP, async scheduling, Ray against their single-engine
    reference): every output equal, no near-tie allowance. Says how many were equal when not."""
    assert len(ours) == len(reference), f"{what}: {len(ours)} outputs vs {len(reference)}"
    exact = sum(a == b for a, b in zip(ours, reference))
    first = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)
    assert exact == len(reference), \
        f"{what}: {exact}/{len(reference)} exactly equal (all required); first difference at output {first}"
    return exact


def single_engine_greedy(model_dir, prompts: list[list[int]], params, **engine_args) -> list[list[int]]:
    """Greedy token ids from an in-process engine (TP=1, sync scheduling): the negative controls
    run it under a monkeypatched fault (tests/broken_variants.py)."""
    from lm_console.engine import LLM

    llm = LLM(str(model_dir), multiprocess=False, **engine_args)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.shutdown()


def assert_aborts_cut_outputs(tokens: dict[str, list[int]], request_ids: list[str], full_outputs: list[list[int]],
                              emitted_at_abort: dict[str, int]) -> None:
    """Each aborted request emitted exactly what it had at the abort (a strict prefix of its
    full output); every other request its full output."""
    for request_id, full in zip(request_ids, full_outputs):
        if request_id in emitted_at_abort:
            got = tokens.get(request_id, [])
            assert got == full[:emitted_at_abort[request_id]] and len(got) < len(full)
        else:
            assert tokens[request_id] == full
