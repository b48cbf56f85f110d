"""Fixtures for the sampler tests: a metadata builder over SamplingParams."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from lm_console.engine.sample.metadata import SamplingMetadata
from lm_console.engine.sampling_params import SamplingParams

MakeMetadata = Callable[..., SamplingMetadata]


@pytest.fixture(autouse=True, params=["c-kernel", "torch"])
def random_sampling_path(request, monkeypatch):
    """Every sampler test runs on both random-sampling paths: the C race and torch's."""
    from lm_console.kernels import cpu_sampling

    if request.param == "torch":
        monkeypatch.setattr(cpu_sampling, "supports", lambda logits: False)
    elif cpu_sampling.load() is None:
        pytest.skip("no C compiler: the CPU sampling kernel is unavailable")
    return request.param


@pytest.fixture
def make_metadata() -> MakeMetadata:
    """make_metadata(params_list, vocab_size, outputs=None, prompts=None, seeds=None)."""

    def make(params_list: list[SamplingParams], vocab_size: int,
             outputs: list[list[int]] | None = None, prompts: list[list[int]] | None = None,
             generators: dict[int, torch.Generator] | None = None) -> SamplingMetadata:
        num_rows = len(params_list)
        outputs = outputs if outputs is not None else [[] for _ in range(num_rows)]
        prompts = prompts if prompts is not None else [[0] for _ in range(num_rows)]
        if generators is None:
            generators = {row: torch.Generator().manual_seed(p.seed)
                          for row, p in enumerate(params_list) if p.seed is not None}
        return SamplingMetadata.from_params(params_list, outputs, prompts, generators,
                                            vocab_size, "cpu")

    return make
