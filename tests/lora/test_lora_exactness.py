"""THE LoRA acceptance test: greedy fp32 output token for token equal to transformers + PEFT.

One batch mixes four random non-zero adapters (ranks 4-16, different module sets, one rsLoRA)
and the base model, with chunked prefill (32-token steps), preemption (a 30-block KV pool) and
prefix-cache hits (a second pass over the same prompts). The negative controls run the same
comparison on broken engines (one request's adapter slot swapped; the scaling dropped) and
assert that it fails.
"""

from __future__ import annotations

import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.lora import LoRARequest
from llm_helpers import compare_greedy, random_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
MAX_INEXACT = 1  # of 20 requests, at most one may differ from PEFT (at a near tie)
NAMES = [None, "all-r8", "attn-r16", "mlp-qv-r4-rs", "all-r8-a32"]


def _lora(adapters, name):  # noqa: ANN001, ANN202
    return None if name is None else LoRARequest(name, NAMES.index(name), str(adapters[name]))


@pytest.fixture(scope="module")
def batch(tiny_llama_dir, tiny_llama_adapters):
    """20 requests: for the base and each adapter, two prompts behind one shared 48-token prefix
    (prefix hits within an adapter, none across), one long prompt (chunked) and one short."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    prefix = random_prompts(vocab, 1, 48, 48, seed=31)[0]
    tails = random_prompts(vocab, 10, 4, 20, seed=32)
    longs = random_prompts(vocab, 5, 90, 130, seed=33)
    shorts = random_prompts(vocab, 5, 3, 12, seed=34)
    prompts, names = [], []
    for i, name in enumerate(NAMES):
        for prompt in (prefix + tails[2 * i], longs[i], prefix + tails[2 * i + 1], shorts[i]):
            prompts.append(prompt)
            names.append(name)
    return prompts, names


@pytest.fixture(scope="module")
def references(tiny_llama_dir, tiny_llama_adapters, batch):
    from lora_helpers import peft_greedy, peft_model

    prompts, names = batch
    refs = {}
    for name in NAMES:
        model = peft_model(tiny_llama_dir, None if name is None else tiny_llama_adapters[name])
        mine = [i for i, n in enumerate(names) if n == name]
        for i, ref in zip(mine, peft_greedy(model, [prompts[i] for i in mine], MAX_TOKENS)):
            refs[i] = ref
    return [refs[i] for i in range(len(prompts))]


def _engine(tiny_llama_dir, **overrides) -> LLM:  # noqa: ANN001
    args = dict(dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=4,
                max_model_len=256, max_num_batched_tokens=32, num_gpu_blocks_override=30,
                enable_prefix_caching=True)
    args.update(overrides)
    return LLM(str(tiny_llama_dir), **args)


def _run(llm: LLM, adapters, batch):  # noqa: ANN001, ANN202
    prompts, names = batch
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[_lora(adapters, n) for n in names])


def _assert_matches_peft(outputs, references, what: str) -> None:  # noqa: ANN001
    exact, failures = compare_greedy(outputs, references)
    print(f"{what}: {exact}/{len(references)} requests match PEFT exactly")
    assert not failures, failures
    assert exact >= len(references) - MAX_INEXACT, f"{what}: only {exact}/{len(references)} match PEFT exactly"


def test_the_adapters_change_the_reference_output(tiny_llama_dir, batch, references) -> None:
    """The check below means something only if each adapter's output is not the base model's:
    PEFT's output of each adapter's prompts differs from the base model's on every prompt."""
    from lora_helpers import peft_greedy, peft_model

    prompts, names = batch
    mine = [i for i, n in enumerate(names) if n is not None]
    base = peft_greedy(peft_model(tiny_llama_dir, None), [prompts[i] for i in mine], MAX_TOKENS)
    same = [names[i] for i, ref in zip(mine, base) if ref.token_ids == references[i].token_ids]
    assert not same, f"adapters whose output equals the base model's: {same}"


def test_mixed_adapters_match_peft_with_chunking_preemption_and_prefix_hits(
        tiny_llama_dir, tiny_llama_adapters, batch, references) -> None:
    llm = _engine(tiny_llama_dir)  # the engine core in its own process: LoRARequest crosses the wire
    try:
        first = _run(llm, tiny_llama_adapters, batch)
        _assert_matches_peft(first, references, "first pass")
        assert llm.get_stats().num_preemptions_total > 0, "the 30-block pool should force preemption"
        second = _run(llm, tiny_llama_adapters, batch)
        _assert_matches_peft(second, references, "second pass (prefix hits)")
        hits = [o.num_cached_tokens for o in second]
        assert sum(h > 0 for h in hits) >= 5, hits
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
def test_each_kernel_matches_peft(tiny_llama_dir, tiny_llama_adapters, batch, references, kernel, monkeypatch) -> None:
    """The reference torch path and the C kernel, each forced (LMC_LORA_KERNEL), in-process."""
    from lm_console.kernels import lora_ops

    if kernel == "cpu" and not lora_ops.cpu_kernel_available():
        pytest.skip("no C compiler: the C LoRA kernel is not built")
    monkeypatch.setenv("LMC_LORA_KERNEL", kernel)
    calls = []
    real = getattr(lora_ops, f"add_lora_{kernel}")
    monkeypatch.setattr(lora_ops, f"add_lora_{kernel}", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = _engine(tiny_llama_dir, multiprocess=False)
    try:
        _assert_matches_peft(_run(llm, tiny_llama_adapters, batch), references, f"LMC_LORA_KERNEL={kernel}")
    finally:
        llm.shutdown()
    assert calls, f"the {kernel} kernel never ran"


@pytest.mark.parametrize("fault", ["swapped_slot", "no_scaling"])
def test_negative_control_a_broken_lora_fails_the_peft_check(
        tiny_llama_dir, tiny_llama_adapters, batch, references, fault, monkeypatch) -> None:
    """The same comparison on an engine that runs one request with another adapter's slot, or
    that drops the scaling (alpha / r), must fail."""
    from lm_console.engine.worker.lora_manager import LoRAManager
    from lm_console.kernels import lora_ops

    if fault == "swapped_slot":
        real_slots = LoRAManager.slots_for

        def swapped(self, requests):  # noqa: ANN001, ANN202
            slots = real_slots(self, requests)
            # the first request with "attn-r16" runs with the slot of "all-r8" (when both are in the step)
            names = [r.lora_name if r is not None else None for r in requests]
            if "attn-r16" in names and "all-r8" in names:
                slots[names.index("attn-r16")] = slots[names.index("all-r8")]
            return slots

        monkeypatch.setattr(LoRAManager, "slots_for", swapped)
    else:
        real_add = lora_ops.add_lora
        monkeypatch.setattr(lora_ops, "add_lora",
                            lambda y, x, a, b, slots, scalings, groups=None: real_add(
                                y, x, a, b, slots, scalings.clone().fill_(1.0), groups))
    llm = _engine(tiny_llama_dir, multiprocess=False)
    try:
        outputs = _run(llm, tiny_llama_adapters, batch)
    finally:
        llm.shutdown()
    with pytest.raises(AssertionError, match="not a near tie|match PEFT exactly"):
        _assert_matches_peft(outputs, references, f"broken engine ({fault})")
