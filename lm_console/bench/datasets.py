"""Benchmark workloads: random token prompts (vLLM's `random`) and shared prefixes (`prefix_repetition`)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(slots=True)
class BenchRequest:
    """One benchmark request: prompt token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random lengths: uniform in [mean * (1 - ratio), mean * (1 + ratio)]."""
    low = max(int(mean * (1 - range_ratio)), 1)
    return low, max(int(mean * (1 + range_ratio)), low)


def random_dataset(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
                   vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Prompts of random tokens with lengths uniform in the given (min, max) ranges."""
    rng = random.Random(seed)
    inputs = [rng.randint(*input_range) for _ in range(num_prompts)]
    outputs = [rng.randint(*output_range) for _ in range(num_prompts)]
    # Ids below 100 are special tokens in the tokenizers we ship.
    return [BenchRequest([rng.randrange(100, vocab_size) for _ in range(n)], m) for n, m in zip(inputs, outputs)]


def shared_prefix_dataset(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                          output_len: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """num_prefixes random prefixes, each followed by random suffixes; prompts shuffled."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, vocab_size) for _ in range(prefix_len)] for _ in range(max(num_prefixes, 1))]
    requests = [
        BenchRequest(prefixes[i % len(prefixes)] + [rng.randrange(100, vocab_size) for _ in range(suffix_len)],
                     output_len)
        for i in range(num_prompts)
    ]
    rng.shuffle(requests)
    return requests
