"""Random non-zero PEFT adapters for the tiny models, and PEFT's greedy reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lm_console.engine.lora.adapter_files import BaseShapes

from llm_helpers import Reference, _top5

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, out_dir: Path, *, rank: int, alpha: float, seed: int,
                 target_modules: list[str] | None = None, use_rslora: bool = False) -> Path:
    """Save a PEFT LoRA adapter for the model at model_dir with random NON-ZERO A and B (PEFT
    starts B at zero, which would make every adapter the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules or ALL_MODULES, lora_dropout=0.0,
                        bias="none", use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:  # [r, in]
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif "lora_B" in name:  # [out, r]
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    assert (out_dir / "adapter_model.safetensors").exists()
    return out_dir


def peft_model(model_dir: Path, adapter_dir: Path | None) -> Any:
    """The HF reference (float32, eager attention) with the adapter applied by PEFT (unmerged)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    if adapter_dir is None:
        return base
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[Reference]:
    """Greedy continuations of each prompt by `model` (one at a time, EOS ignored), with the
    top-5 fp32 logits of each step (llm_helpers.compare_greedy's near-tie rule)."""
    references = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            tokens: list[int] = []
            tops = []
            for _ in range(max_new_tokens):
                logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
                token = int(logits.argmax())
                tokens.append(token)
                tops.append(_top5(logits))
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            references.append(Reference(tokens, tops))
    return references


# the tiny Llama's shapes: hidden 64, 4 heads / 2 KV heads of 16, intermediate 128, 2 layers
BASE = BaseShapes(hidden=64, q=64, kv=32, inter=128, num_layers=2)
PREFIX = "base_model.model.model.layers"
DIMS = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
        "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}


def write_adapter(path: Path, rank: int = 4, modules: tuple[str, ...] = ("q_proj", "v_proj"), layers: int = 2,
                  config: dict | None = None, dims: dict | None = None, extra: dict | None = None,
                  zero_b: bool = False) -> Path:
    """A PEFT-layout adapter written by hand (in, out per module from `dims`; zero_b: B all
    zero, an adapter that changes nothing)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    dims = dims or DIMS
    tensors = {}
    for layer in range(layers):
        for module in modules:
            sub = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            d_in, d_out = dims[module]
            tensors[f"{PREFIX}.{layer}.{sub}.{module}.lora_A.weight"] = torch.randn(rank, d_in)
            tensors[f"{PREFIX}.{layer}.{sub}.{module}.lora_B.weight"] = (torch.zeros(d_out, rank) if zero_b
                                                                        else torch.randn(d_out, rank))
    tensors.update(extra or {})
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules), "bias": "none"}
    cfg.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


