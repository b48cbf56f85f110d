"""Perplexity of a loaded model on a fixed text every machine has: standard-library docstrings.

The text is built at run time from the docstrings of a fixed list of Python standard-library
modules (module, then public classes and functions in name order), so nothing is downloaded and
no one's prose is copied into the repository. It depends on the Python version's docstrings,
so compare perplexities measured in one run (as benchmarks/perplexity.py does), not across
machines.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lm_console.engine.forward_context import set_forward_context

STDLIB_MODULES = ("json", "heapq", "bisect", "textwrap", "functools", "itertools", "string",
                  "collections", "pathlib", "argparse", "shutil", "fractions", "statistics",
                  "difflib", "calendar")


def stdlib_text(modules: tuple[str, ...] = STDLIB_MODULES) -> str:
    """The docstrings of `modules` and their public members, joined by blank lines."""
    parts = []
    for name in modules:
        module = importlib.import_module(name)
        if module.__doc__:
            parts.append(inspect.cleandoc(module.__doc__))
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            member = getattr(module, attr)
            if (inspect.isclass(member) or inspect.isfunction(member)) and \
                    getattr(member, "__module__", None) == name and member.__doc__:
                parts.append(f"{attr}: {inspect.cleandoc(member.__doc__)}")
    return "\n\n".join(parts)


def window_perplexity(token_ids: list[int], window: int, logits_of: Callable[[Tensor], Tensor]) -> float:
    """exp(mean negative log-likelihood) of each token given the ones before it in its window
    (non-overlapping windows of `window` tokens, each a fresh context); logits_of(ids) gives
    the logits [len(ids) - 1, vocab] predicting ids[1:] (any system: benchmarks/perplexity.py
    holds llama.cpp to the same windows)."""
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        ids = torch.tensor(token_ids[start : start + window], dtype=torch.int64)
        if ids.numel() < 2:
            break
        nll = torch.nn.functional.cross_entropy(logits_of(ids).double(), ids[1:], reduction="sum")
        total += float(nll)
        count += ids.numel() - 1
    return math.exp(total / count)


@torch.inference_mode()
def perplexity(model: nn.Module, token_ids: list[int], window: int = 512) -> float:
    """window_perplexity of a loaded model (one forward per window)."""

    def logits_of(ids: Tensor) -> Tensor:
        with set_forward_context(None):
            hidden = model(ids, torch.arange(ids.numel()))
        return model.compute_logits(hidden[:-1])

    return window_perplexity(token_ids, window, logits_of)
