"""How sensitive a tiny model's greedy output is to the whole context (tests/models/test_tiny_models.py).

A model whose greedy output ignores its context (e.g. one that repeats the last prompt token) makes
every equality test built on it weak: an engine that drops attention, a layer, or gets a position
wrong still matches. `measure` runs HF greedy decoding (no KV cache, one forward a step over the
whole sequence, float32) on the model and on three broken variants of it and counts how many
prompts' outputs change:

- zero_attention: every layer's attention output set to zero;
- drop_layer: the first or the last decoder layer skipped (its output is its input); the smaller
  of the two fractions is reported;
- shift_positions: positions off by one from the last prompt token on (the gap an engine opens when
  a decode step or a chunk boundary gets the wrong position);

and how many outputs start with a repeat of the last prompt token.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

NUM_PROMPTS = 20
PROMPT_LEN = 16
NEW_TOKENS = 8


@dataclass
class Sensitivity:
    zero_attention: float  # fraction of prompts whose greedy output changes
    drop_layer: float  # the smallest such fraction over the layers
    shift_positions: float
    last_token_repeat: float  # fraction of outputs whose first token is the prompt's last token

    def __str__(self) -> str:
        return (f"zero-attention {self.zero_attention:.2f}, drop-layer {self.drop_layer:.2f}, "
                f"shift-positions {self.shift_positions:.2f}, last-token-repeat {self.last_token_repeat:.2f}")


def prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """NUM_PROMPTS random prompts of PROMPT_LEN tokens (ids 3.. : no BOS/EOS/pad)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(NUM_PROMPTS)]


def greedy(model: Any, batch: list[list[int]], shift: int = 0) -> list[list[int]]:
    """Greedy continuations of equal-length prompts; `shift` adds to the positions from the last
    prompt token on."""
    ids = torch.tensor(batch)
    plen = ids.shape[1]
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            n = ids.shape[1]
            pos = torch.arange(n)
            pos[plen - 1:] += shift
            logits = model(input_ids=ids, position_ids=pos.expand(ids.shape[0], n), use_cache=False,
                           logits_to_keep=1).logits
            ids = torch.cat([ids, logits[:, -1].float().argmax(-1, keepdim=True)], dim=1)
    return ids[:, plen:].tolist()


def _layers(model: Any) -> Any:
    return model.model.layers


@contextmanager
def zero_attention(model: Any) -> Iterator[None]:
    def hook(_module: Any, _args: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (torch.zeros_like(out[0]), *out[1:])
        return torch.zeros_like(out)

    handles = [layer.self_attn.register_forward_hook(hook) for layer in _layers(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def drop_layer(model: Any, index: int) -> Iterator[None]:
    def hook(_module: Any, args: Any, kwargs: Any, out: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    handle = _layers(model)[index].register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _changed(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x != y for x, y in zip(a, b)) / len(a)


def load(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def last_token_repeat(model: Any, batch: list[list[int]] | None = None) -> float:
    batch = batch or prompts(model.config.vocab_size)
    return sum(out[0] == p[-1] for out, p in zip(greedy(model, batch), batch)) / len(batch)


def measure(model: Any, batch: list[list[int]] | None = None) -> Sensitivity:
    batch = batch or prompts(model.config.vocab_size)
    base = greedy(model, batch)
    with zero_attention(model):
        zero = _changed(base, greedy(model, batch))
    drops = []
    for i in sorted({0, len(_layers(model)) - 1}):
        with drop_layer(model, i):
            drops.append(_changed(base, greedy(model, batch)))
    shifted = _changed(base, greedy(model, batch, shift=1))
    repeat = sum(out[0] == p[-1] for out, p in zip(base, batch)) / len(batch)
    return Sensitivity(zero, min(drops), shifted, repeat)


