"""LoRA on the default CPU path: the base stays quantized (int8 / GGUF kernels) and the adapter's
delta is added beside it, by the layer-by-layer forward and by the C decode stack alike (the
stack calls the same LoRA kernel after each linear; tests/models/test_decode_stack.py checks the
two bit for bit)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lm_console.engine.models import lora
from lm_console.engine.models.layers import Linear
from lm_console.kernels import cpu_quant, lora_ops
from lora_helpers import write_adapter

MAX_LORAS, RANK = 3, 8


def _mapping(slots: list[int]) -> lora.LoRAMapping:
    token_slots = torch.tensor(slots, dtype=torch.int64)
    return lora.LoRAMapping(token_slots, torch.tensor([0.5, 2.0, 1.25]), lora_ops.slot_groups(token_slots))


def _fill(slots: lora.LoRASlots, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for slot in range(MAX_LORAS):
        for index, size in enumerate(slots.out_sizes):
            a = torch.randn(RANK, slots.a.shape[2], generator=gen) / 8
            b = torch.randn(size, RANK, generator=gen) / 4
            slots.set_projection(slot, index, a.to(slots.a.dtype), b.to(slots.b.dtype))


@pytest.fixture
def torch_kernel(monkeypatch):
    monkeypatch.setenv("LMC_LORA_KERNEL", "torch")  # the same ops as the expectation below


def test_a_quantized_linear_keeps_its_kernel_and_adds_the_delta_beside(torch_kernel) -> None:
    if cpu_quant.load() is None:
        pytest.skip("no C compiler: no quantized kernels")
    gen = torch.Generator().manual_seed(0)
    linear = Linear(64, 96, False, torch.bfloat16)
    linear.weight.data.copy_(torch.randn(96, 64, generator=gen) / 8)
    linear.set_quant_weight(cpu_quant.quantize_int8_per_channel(linear.weight.detach()))
    linear.lora = lora.LoRASlots(64, [64, 32], MAX_LORAS, RANK, torch.bfloat16, torch.device("cpu"))
    _fill(linear.lora, 1)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    slots = [0, -1, 2, 1, -1]
    base = cpu_quant.quant_linear(x, linear.quant, None)
    expected = lora_ops.add_lora_torch(base.clone(), x, linear.lora.a, linear.lora.b, torch.tensor(slots),
                                       torch.tensor([0.5, 2.0, 1.25]))
    with lora.lora_step(_mapping(slots)):
        got = linear(x)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 4]], base[[1, 4]]), "the base model's rows must be the quantized kernel's own"
    assert not torch.equal(got[[0, 2, 3]], base[[0, 2, 3]])


def test_the_fused_swiglu_down_projection_adds_the_delta_of_the_activation(torch_kernel) -> None:
    if cpu_quant.load() is None:
        pytest.skip("no C compiler: no quantized kernels")
    from lm_console.engine.models.llama import LlamaMLP

    config = SimpleNamespace(hidden_size=64, intermediate_size=128, mlp_bias=False)
    mlp = LlamaMLP(config, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.weight.data.copy_(torch.randn(linear.weight.shape, generator=gen) / 8)
        linear.set_quant_weight(cpu_quant.quantize_int8_per_channel(linear.weight.detach()))
    mlp.down_proj.lora = lora.LoRASlots(128, [64], MAX_LORAS, RANK, torch.bfloat16, torch.device("cpu"))
    _fill(mlp.down_proj.lora, 3)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    slots = [1, -1, 0, 2]
    base = mlp(x)  # no step mapping: the fused kernel alone
    gate_up = mlp.gate_up_proj(x)
    expected = lora_ops.add_lora_torch(base.clone(), mlp.act_fn(gate_up), mlp.down_proj.lora.a,
                                       mlp.down_proj.lora.b, torch.tensor(slots), torch.tensor([0.5, 2.0, 1.25]))
    with lora.lora_step(_mapping(slots)):
        got = mlp(x)
    assert torch.equal(got, expected)
    assert torch.equal(got[1], base[1])


EMBEDDED = {"hidden": 576, "q": 576, "kv": 192, "inter": 1536, "layers": 30}


def _embedded_dims() -> dict:
    h, q, kv, i = EMBEDDED["hidden"], EMBEDDED["q"], EMBEDDED["kv"], EMBEDDED["inter"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


@pytest.mark.slow
def test_the_default_llm_serves_lora_beside_its_quantized_weights(tmp_path, monkeypatch) -> None:
    """LLM() as users get it (the embedded GGUF model, bf16, quantized weights, the C decode
    stack): an adapter whose B is zero gives exactly the base model's tokens, a random one
    changes them, and the decode stack serves the adapters' decode steps too."""
    from lm_console.engine import LLM, SamplingParams
    from lm_console.engine.lora import LoRARequest
    from lm_console.engine.models import decode_stack

    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    zero = write_adapter(tmp_path / "zero", rank=8, modules=modules, layers=30, dims=_embedded_dims(), zero_b=True)
    noisy = write_adapter(tmp_path / "noisy", rank=8, modules=modules, layers=30, dims=_embedded_dims())
    stack_runs: list[bool] = []  # per step the stack served: whether it had an adapter's token
    real_run = decode_stack.DecodeStack.run

    def spy(self, ids, pos):
        out = real_run(self, ids, pos)
        if out is not None:
            stack_runs.append(lora.step_has_adapters())
        return out

    monkeypatch.setattr(decode_stack.DecodeStack, "run", spy)
    llm = LLM(enable_lora=True, max_loras=2, max_lora_rank=8, multiprocess=False, max_model_len=512)
    try:
        assert llm.config.model_config.quantization is not None, "the default path is the quantized one"
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert stack_runs and not any(stack_runs)
        stack_runs.clear()
        with_zero = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("zero", 1, str(zero)))
        assert [o.outputs[0].token_ids for o in with_zero] == base
        assert stack_runs and all(stack_runs), "the decode stack serves the adapter's decode steps"
        with_noise = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("noisy", 2, str(noisy)))
        assert [o.outputs[0].token_ids for o in with_noise] != base
    finally:
        llm.shutdown()
