"""Fixtures of the LoRA tests: four random non-zero PEFT adapters for the tiny Llama."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# (name, rank, alpha, target modules (None: all seven), use_rslora): different ranks, scalings
# and module sets, so that a delta applied in the wrong place or with the wrong size shows.
ADAPTERS = [
    ("all-r8", 8, 16.0, None, False),
    ("attn-r16", 16, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    ("mlp-qv-r4-rs", 4, 8.0, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], True),
    ("all-r8-a32", 8, 32.0, None, False),
]


@pytest.fixture(scope="session")
def tiny_llama_adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """name -> adapter directory (adapter_config.json + adapter_model.safetensors)."""
    pytest.importorskip("peft")
    from lora_helpers import make_adapter

    root = tmp_path_factory.mktemp("tiny-llama-adapters")
    return {name: make_adapter(tiny_llama_dir, root / name, rank=rank, alpha=alpha, seed=10 + i,
                               target_modules=modules, use_rslora=rslora)
            for i, (name, rank, alpha, modules, rslora) in enumerate(ADAPTERS)}
