"""The whole-stack decode driver (lm_console/engine/models/decode_stack.py) against the layer-by-layer forward.

Quantized models: the driver calls the same kernels in the same order, so every logit of every
step must be bit-identical, with the driver serving the pure-decode steps (counted) and the
usual forward the others (prefill, chunked prefill beside decodes, more rows than its bound:
MAX_ROWS quantized, 16 with AMX, 8 dense).
Dense bf16: the driver's own GEMV accumulates in another order than
oneDNN, so the logits are close and the greedy tokens equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from lm_console.engine.models import decode_stack, lora
from lm_console.engine.models.layers import Linear, bump_weights_version
from lm_console.engine.models.loader import load_model
from lm_console.engine.models.quant import quantize_model
from lm_console.kernels import cpu_attention, cpu_decode, cpu_quant, lora_ops
from paged_model_harness import PagedHarness

pytestmark = [pytest.mark.slow, pytest.mark.skipif(cpu_quant.load() is None or cpu_decode.load() is None,
                                reason="no C compiler (or LMC_CPU_KERNELS=0): no driver")]


@pytest.fixture
def driver_steps(monkeypatch) -> list[int]:
    """Rows of each step the driver served (so a test can tell it really ran)."""
    served: list[int] = []
    real = decode_stack.DecodeStack.run

    def spy(self, input_ids, positions):
        out = real(self, input_ids, positions)
        if out is not None:
            served.append(input_ids.shape[0])
        return out

    monkeypatch.setattr(decode_stack.DecodeStack, "run", spy)
    return served


def _quantize_b4(model: torch.nn.Module) -> None:
    """Give every linear random 4-bit block weights (the GGUF Q4_1 layout) and the embedding b8."""
    rng = np.random.default_rng(0)
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.device.type != "meta":
            n, k = module.weight.shape
            nb = -(-k // cpu_quant.BLOCK)
            q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
            d = rng.uniform(0.002, 0.02, size=(n, nb)).astype(np.float16)
            m = (-8 * d.astype(np.float32) + rng.normal(0, 0.01, size=(n, nb))).astype(np.float16)
            module.set_quant_weight(cpu_quant.pack_blocks("b4", q, d, m, "Q4_1"))
            module.weight = torch.nn.Parameter(torch.empty(n, k, dtype=module.weight.dtype, device="meta"),
                                               requires_grad=False)


def _model(model_dir, quant: str) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, torch.bfloat16, torch.device("cpu"))
    if quant == "int8":
        quantize_model(model, "int8")
    elif quant == "b4":
        _quantize_b4(model)
    return model


def _run(model: torch.nn.Module, prompt: list[int], kv_cache_dtype: torch.dtype | None = None,
         harness_cls: type[PagedHarness] = PagedHarness) -> tuple[torch.Tensor, list[int]]:
    """Prefill, chunked prefill beside a decode, decodes of 1, 3 and 9 rows: all logits, and
    the greedy tokens of the decode-only steps."""
    harness = harness_cls(model, num_blocks=96, block_size=16, kv_cache_dtype=kv_cache_dtype)
    got = [harness.step([("a", prompt[:21])])]
    for token in prompt[21:24]:  # one row
        got.append(harness.step([("a", [token])]))
    got.append(harness.step([("b", prompt[:7]), ("a", [prompt[24]])]))  # prefill + decode: fallback
    got.append(harness.step([("c", prompt[5:9]), ("d", prompt[9:12])] + [(f"e{i}", prompt[i:i + 2])
                                                                        for i in range(13)]))
    names = ["a", "b", "c", "d"] + [f"e{i}" for i in range(13)]  # 17 requests
    greedy = []
    for step in range(4):
        # 3 rows twice, then 17, then 12 (quantized: the driver, up to MAX_ROWS; dense: > 8, fallback)
        rows = names[:3] if step < 2 else names if step == 2 else names[:12]
        logits = harness.step([(name, [prompt[30 + step + i]]) for i, name in enumerate(rows)])
        got.append(logits)
        greedy += logits.argmax(dim=-1).tolist()
    return torch.cat(got), greedy


def _quantized_driver_steps() -> list[int]:
    """The rows of _run's steps the driver serves for a quantized model: the 17-row step only
    where the bound is above 16 (a CPU with AMX: cpu_quant.dense_rows() is 16 there)."""
    bound = min(decode_stack.MAX_ROWS, cpu_quant.dense_rows())
    return [1, 1, 1, 3, 3] + ([17] if bound >= 17 else []) + [12]


def _both(model_dir, quant: str, monkeypatch, mode: str = "1", kv_cache_dtype: torch.dtype | None = None,
          adapters: bool = False):
    prompt = torch.randint(0, 500, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    harness_cls = _AdapterHarness if adapters else PagedHarness
    make = _model_with_adapters if adapters else _model
    monkeypatch.setenv("LMC_DECODE_STACK", "0")
    reference = _run(make(model_dir, quant), prompt, kv_cache_dtype, harness_cls)
    model = make(model_dir, quant)  # the same weights (loaded and quantized alike)
    monkeypatch.setenv("LMC_DECODE_STACK", mode)
    bump_weights_version()
    return reference, _run(model, prompt, kv_cache_dtype, harness_cls)


# -- LoRA: adapter steps stay in the driver -------------------------------------------------------
MAX_LORAS, LORA_RANK = 3, 8
SCALINGS = torch.tensor([0.5, 2.0, 1.25])


def _adapter_slot(name: str) -> int:
    """Each request's adapter slot (-1: the base model), so that every step mixes adapters and base."""
    fixed = {"a": 0, "b": -1, "c": 1, "d": 2}
    return fixed[name] if name in fixed else int(name[1:]) % (MAX_LORAS + 1) - 1


class _AdapterHarness(PagedHarness):
    """Every step runs with a LoRA mapping: each token the slot of its request."""

    def step(self, chunks: list[tuple[str, list[int]]]) -> torch.Tensor:
        token_slots = torch.tensor([_adapter_slot(name) for name, tokens in chunks for _ in tokens],
                                   dtype=torch.int64)
        mapping = lora.LoRAMapping(token_slots, SCALINGS, lora_ops.slot_groups(token_slots))
        with lora.lora_step(mapping):
            return super().step(chunks)


def _model_with_adapters(model_dir, quant: str) -> torch.nn.Module:
    """_model's weights with 3 random non-zero adapters (rank 8, every projection of every layer)."""
    model = _model(model_dir, quant)
    lora.attach_lora_slots(model, MAX_LORAS, LORA_RANK)
    gen = torch.Generator().manual_seed(5)
    for _, _, linear in lora.lora_linears(model):
        slots = linear.lora
        for slot in range(MAX_LORAS):
            for index, size in enumerate(slots.out_sizes):
                a = torch.randn(LORA_RANK, slots.a.shape[2], generator=gen) / slots.a.shape[2] ** 0.5
                b = torch.randn(size, LORA_RANK, generator=gen) / 2
                slots.set_projection(slot, index, a.to(slots.a.dtype), b.to(slots.b.dtype))
    return model


@pytest.mark.parametrize("quant", ["int8", "b4"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_quantized_decode_steps_are_bit_identical(fixture, quant, request, monkeypatch, driver_steps):
    (ref_logits, ref_greedy), (logits, greedy) = _both(request.getfixturevalue(fixture), quant, monkeypatch)
    assert driver_steps == _quantized_driver_steps(), "the driver serves exactly the pure-decode steps"
    assert torch.equal(logits, ref_logits)
    assert greedy == ref_greedy


@pytest.mark.skipif(not cpu_attention.supports_int8(64, 4, 2), reason="no AVX512-BF16: the int8 cache runs on torch")
def test_int8_kv_cache_decode_steps_are_bit_identical(tiny_llama_d64_dir, monkeypatch, driver_steps):
    """The int8 cache (head_dim 64): the driver writes and reads it with the kernels the layer
    path calls (its table holds the int8 writer and attention), so the logits are the same bits."""
    (ref_logits, ref_greedy), (logits, greedy) = _both(tiny_llama_d64_dir, "b4", monkeypatch,
                                                       kv_cache_dtype=torch.int8)
    assert driver_steps == _quantized_driver_steps()
    assert torch.equal(logits, ref_logits)
    assert greedy == ref_greedy


def test_quantized_steps_above_the_row_bound_take_the_usual_forward(tiny_llama_dir, monkeypatch, driver_steps):
    monkeypatch.setattr(decode_stack, "MAX_ROWS", 16)  # as on a CPU with AMX (cpu_quant.dense_rows())
    (ref_logits, ref_greedy), (logits, greedy) = _both(tiny_llama_dir, "b4", monkeypatch)
    assert driver_steps == [1, 1, 1, 3, 3, 12], "17 rows > 16: the usual forward"
    assert torch.equal(logits, ref_logits)
    assert greedy == ref_greedy


@pytest.mark.skipif(not (cpu_decode.load() is not None and cpu_decode.load().decode_stack_has_bf16()),
                    reason="no AVX512-BF16: dense bf16 models keep the layer path (oneDNN)")
def test_dense_bf16_is_close_with_equal_greedy_tokens(tiny_llama_dir, monkeypatch, driver_steps):
    (ref_logits, ref_greedy), (logits, greedy) = _both(tiny_llama_dir, "none", monkeypatch)
    assert driver_steps == [1, 1, 1, 3, 3]
    scale = ref_logits.abs().max()
    assert (logits - ref_logits).abs().max() <= 0.02 * scale
    assert greedy == ref_greedy


@pytest.mark.parametrize("mode,dtype", [("quant", torch.bfloat16), ("1", torch.float32)])
def test_dense_bf16_off_in_quant_mode_and_float32_never(mode, dtype, tiny_llama_dir, monkeypatch, driver_steps):
    monkeypatch.setenv("LMC_DECODE_STACK", mode)
    bump_weights_version()
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    model = load_model(tiny_llama_dir, config, dtype, torch.device("cpu"))
    assert decode_stack.unsupported_reason(model.model) is not None
    prompt = list(range(10, 40))
    harness = PagedHarness(model)
    harness.step([("a", prompt)])
    harness.step([("a", [3])])
    assert driver_steps == []


def test_rebound_kv_caches_rebuild_the_plan(tiny_llama_dir, monkeypatch, driver_steps):
    """A new set of KV caches (bind_kv_caches again) must be what the driver reads and writes."""
    first, second = (torch.randint(0, 500, (60,), generator=torch.Generator().manual_seed(s)).tolist()
                     for s in (2, 3))
    monkeypatch.setenv("LMC_DECODE_STACK", "0")
    reference = _run(_model(tiny_llama_dir, "int8"), second)
    monkeypatch.setenv("LMC_DECODE_STACK", "1")
    bump_weights_version()
    model = _model(tiny_llama_dir, "int8")
    _run(model, first)
    logits, greedy = _run(model, second)  # a new harness: new caches bound
    assert driver_steps == _quantized_driver_steps() * 2
    assert torch.equal(logits, reference[0]) and greedy == reference[1]


def test_a_slot_past_the_cache_is_refused_not_written(tiny_llama_dir, monkeypatch, driver_steps):
    monkeypatch.setenv("LMC_DECODE_STACK", "1")
    bump_weights_version()
    harness = PagedHarness(_model(tiny_llama_dir, "int8"), num_blocks=8, block_size=16)
    harness.step([("a", list(range(1, 17)))])  # one full block
    harness.step([("b", [3])])  # a one-token prompt: a query of 1, the driver's
    assert driver_steps == [1]
    before = [cache.clone() for cache in harness.kv_caches]
    harness.free_blocks = [8]  # one past the 8-block cache: position 16 of "a" lands in it
    with pytest.raises(IndexError, match="past the cache's 128 slots"):
        harness.step([("a", [5]), ("b", [6])])
    assert driver_steps == [1]  # the driver declined (nothing written); the usual forward named the slot
    assert all(torch.equal(cache, old) for cache, old in zip(harness.kv_caches, before))


def test_a_block_table_entry_past_the_cache_is_refused(tiny_llama_dir, monkeypatch, driver_steps):
    """Slots in the cache but an earlier block-table entry outside it: the driver declines the
    step and the usual forward's attention names the bad table (no read out of bounds)."""
    monkeypatch.setenv("LMC_DECODE_STACK", "1")
    bump_weights_version()
    harness = PagedHarness(_model(tiny_llama_dir, "int8"), num_blocks=8, block_size=16)
    harness.step([("a", list(range(1, 17)))])  # one full block
    harness.step([("b", [3])])
    assert driver_steps == [1]
    harness.seqs["a"].block_ids[0] = 8  # one past the 8-block cache; "a"'s next slot is in a new block
    with pytest.raises(IndexError, match="outside the cache's 8 blocks"):
        harness.step([("a", [5]), ("b", [6])])
    assert driver_steps == [1]


@pytest.mark.skipif(not lora_ops.cpu_kernel_available(), reason="no C LoRA kernel: adapter steps keep the layer path")
@pytest.mark.parametrize("quant", ["int8", "b4"])
def test_adapter_steps_stay_in_the_driver_bit_identical(quant, tiny_llama_dir, monkeypatch, driver_steps):
    """Steps mixing 3 adapters and the base: the driver adds each linear's deltas with the
    layer path's LoRA kernel on the same inputs (the down projection's: silu(gate) * up), so it
    serves every pure-decode step and every logit is the same bits."""
    (ref_logits, ref_greedy), (logits, greedy) = _both(tiny_llama_dir, quant, monkeypatch, adapters=True)
    assert driver_steps == _quantized_driver_steps(), "adapter steps are the driver's too"
    assert torch.equal(logits, ref_logits)
    assert greedy == ref_greedy
    base_logits, _ = _run(_model(tiny_llama_dir, quant), torch.randint(
        0, 500, (60,), generator=torch.Generator().manual_seed(1)).tolist())
    changed = (logits - base_logits).abs().amax(dim=-1) > 0
    assert changed.float().mean() > 0.5, "the adapters must change the logits (else the test proves nothing)"


def test_negative_control_a_driver_that_reads_half_of_each_adapter_differs(tiny_llama_dir, monkeypatch,
                                                                           driver_steps):
    """The equality above fails when the driver's deltas are wrong: a plan that reads only half
    of each adapter's rank (the layer path the whole) gives other logits."""
    if not lora_ops.cpu_kernel_available():
        pytest.skip("no C LoRA kernel")
    real = decode_stack._lora_fields
    monkeypatch.setattr(decode_stack, "_lora_fields",
                        lambda linear: (lambda f: [f[0], f[1], f[2] // 2])(real(linear)))
    (ref_logits, _), (logits, _) = _both(tiny_llama_dir, "int8", monkeypatch, adapters=True)
    assert driver_steps == _quantized_driver_steps()
    assert not torch.equal(logits, ref_logits)


def test_adapter_steps_take_the_layer_path_with_the_torch_lora_kernel(tiny_llama_dir, monkeypatch, driver_steps):
    """LMC_LORA_KERNEL=torch: the layer path adds the deltas with torch's ops, which the driver
    does not call, so it leaves the adapter steps to that path."""
    monkeypatch.setenv("LMC_LORA_KERNEL", "torch")
    (ref_logits, _), (logits, _) = _both(tiny_llama_dir, "int8", monkeypatch, adapters=True)
    assert driver_steps == []
    assert torch.equal(logits, ref_logits)
