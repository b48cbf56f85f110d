"""bf16 forward with the fused CPU kernels (lm_console/kernels/cpu_ops.py) vs the plain torch bf16 path.

The kernels round once where torch's op chain rounds after every op, so the two bf16 paths
differ in the last bits; both are checked against our float32 forward (itself HF-exact, see
test_llama_family.py): the fused path must be no further from it than the torch path is.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from lm_console.engine.models.loader import load_model
from lm_console.kernels import cpu_ops
from paged_model_harness import PagedHarness

pytestmark = pytest.mark.skipif(cpu_ops.load() is None,
                                reason="no C compiler (or LMC_CPU_KERNELS=0): torch path only")


@pytest.fixture
def kernel_calls(monkeypatch) -> dict[str, int]:
    """Counts the fused kernel calls (so a test can tell the fused path really ran)."""
    calls: dict[str, int] = {}
    for name in ("silu_and_mul", "rms_norm", "add_rms_norm_", "rms_norm_heads_", "rotary_neox_"):
        real = getattr(cpu_ops, name)

        @functools.wraps(real)
        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(cpu_ops, name, spy)
    return calls


def _logits(model_dir: Path, dtype: torch.dtype, prompt: list[int]) -> torch.Tensor:
    """Chunked prefill, a second request joining, then batched decodes: all logits."""
    config = AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, dtype, torch.device("cpu"))
    harness = PagedHarness(model)
    got = [harness.step([("a", prompt[:19])]),
           harness.step([("a", prompt[19:]), ("b", prompt[:5])])]
    for token in prompt[:4]:
        got.append(harness.step([("b", [token]), ("a", [token])]))
    return torch.cat(got)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_fused_bf16_is_at_least_as_close_to_float32(fixture, request, kernel_calls, monkeypatch):
    model_dir = request.getfixturevalue(fixture)
    prompt = torch.randint(0, 500, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    exact = _logits(model_dir, torch.float32, prompt)
    assert not kernel_calls, "float32 must stay on the torch path"

    fused = _logits(model_dir, torch.bfloat16, prompt)
    assert kernel_calls["silu_and_mul"] and kernel_calls["add_rms_norm_"] and kernel_calls["rotary_neox_"]
    assert bool(kernel_calls.get("rms_norm_heads_")) == (fixture == "tiny_qwen3_dir")
    monkeypatch.setattr(cpu_ops, "load", lambda: None)
    plain = _logits(model_dir, torch.bfloat16, prompt)

    fused_err, plain_err = (fused - exact).abs(), (plain - exact).abs()
    assert fused_err.mean() <= plain_err.mean() * 1.05, (fused_err.mean(), plain_err.mean())
    assert fused_err.max() <= 0.02 * exact.abs().max()


def test_gemma3_bf16_takes_the_rope_kernel_of_the_shared_layer(tiny_gemma3_dir, kernel_calls, monkeypatch):
    """Gemma3 picks up the fused rope through RotaryEmbedding (the kernel choice is the layer's);
    its (1 + w) norms and GELU MLP have no kernel and stay on torch."""
    prompt = torch.randint(0, 500, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    exact = _logits(tiny_gemma3_dir, torch.float32, prompt)
    assert not kernel_calls, "float32 must stay on the torch path"
    fused = _logits(tiny_gemma3_dir, torch.bfloat16, prompt)
    assert set(kernel_calls) == {"rotary_neox_"}
    monkeypatch.setattr(cpu_ops, "load", lambda: None)
    plain = _logits(tiny_gemma3_dir, torch.bfloat16, prompt)

    fused_err, plain_err = (fused - exact).abs(), (plain - exact).abs()
    assert fused_err.mean() <= plain_err.mean() * 1.05, (fused_err.mean(), plain_err.mean())
    assert fused_err.max() <= 0.02 * exact.abs().max()


def _logprob(entry) -> float:
    return float(getattr(entry, "logprob", entry))


@pytest.mark.slow
def test_engine_bf16_greedy_agrees_with_and_without_kernels(embedded_model_dir, make_llm,
                                                            kernel_calls, monkeypatch):
    """SmolLM2 bf16, greedy, 12 tokens on 6 prompts: up to where the two paths part, every token
    has the same log-probability on both (within 0.3 nats); where they part, the two tokens are a
    near tie on both sides: each in the other's top 5 (vLLM's check_logprobs_close rule) and
    within 0.3 nats of each other. How many prompts part depends on the CPU (4 of 6 on an AVX2-only
    one, whose oneDNN has no bf16 prepacking; 0-2 with AVX512-BF16). bf16 logits come in
    steps of ~0.06-0.125 at this model's scale, so exact ties between candidates are common
    (even the float32 model has a 0.03-nat first-token tie on one of these prompts)."""
    from lm_console.engine import SamplingParams
    from llm_helpers import text_prompts

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    prompts = [{"prompt_token_ids": p} for p in text_prompts(tokenizer, 6, 20, 160, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)

    def generate():
        llm = make_llm(None, dtype="bfloat16", multiprocess=False, enable_prefix_caching=False,
                       quantization="none")  # the dense bf16 path these kernels serve
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = generate()
    assert kernel_calls.get("add_rms_norm_", 0) > 0
    monkeypatch.setattr(cpu_ops, "load", lambda: None)
    plain = generate()
    for i, (a, b) in enumerate(zip(fused, plain)):
        pos = next((p for p, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        for p in range(pos):  # the shared tokens: the same log-probability on both paths
            token = a.token_ids[p]
            gap = _logprob(a.logprobs[p][token]) - _logprob(b.logprobs[p][token])
            assert abs(gap) <= 0.3, f"prompt {i}: token {p} ({token}) is {gap:.3f} nats apart on the two paths"
        if pos == len(a.token_ids):
            continue
        ta, tb = a.token_ids[pos], b.token_ids[pos]
        assert ta in b.logprobs[pos] and tb in a.logprobs[pos], (
            f"prompt {i}: token {pos} differs ({ta} vs {tb}), not in each other's top 5")
        for out in (a, b):
            gap = _logprob(out.logprobs[pos][ta]) - _logprob(out.logprobs[pos][tb])
            assert abs(gap) <= 0.3, f"prompt {i}: token {pos}: {ta} vs {tb} are {gap:.3f} nats apart"
