"""LoRA adapters with speculative decoding: a verification step's draft rows carry their request's
adapter slot like any scheduled token, so greedy output with drafts is token for token the output
without them, for a batch mixing an adapter and the base model. The drafts come from an oracle
that knows each request's answer (with the adapter or without) and spoils a third of them, so
drafts are both accepted and rejected at every position."""

from __future__ import annotations

import random

import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.lora import LoRARequest
from lora_helpers import DIMS, write_adapter

pytestmark = pytest.mark.slow

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ENGINE = dict(dtype="float32", multiprocess=False, enable_lora=True, max_loras=2, max_lora_rank=8)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}


class SpoilingOracle:
    """Proposes the rest of the known sequence the request's tokens start; spoils one token of
    a third of the proposals."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences
        self.rng = random.Random(0)

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        for sequence in self.sequences:
            if len(sequence) > len(token_ids) and sequence[:len(token_ids)] == token_ids:
                proposal = sequence[len(token_ids):len(token_ids) + max_tokens]
                if proposal and self.rng.random() < 1 / 3:
                    proposal[self.rng.randrange(len(proposal))] += 1
                return proposal
        return []

    def forget(self, request_id: str) -> None:
        """Stateless."""


def test_adapters_with_drafts_are_greedy_equal_to_adapters_without(make_llm, tiny_llama_dir, tmp_path) -> None:  # noqa: ANN001
    adapter = LoRARequest("noisy", 1, str(write_adapter(tmp_path / "noisy", rank=8, modules=MODULES, layers=2,
                                                        dims=DIMS)))
    rng = random.Random(3)
    token_lists = [[rng.randrange(3, 500) for _ in range(rng.randint(6, 40))] for _ in range(16)]
    prompts = [{"prompt_token_ids": p} for p in token_lists]
    loras = [adapter if i % 2 == 0 else None for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(llm: LLM, with_loras: list[LoRARequest | None] | None) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False,
                                                                    lora_request=with_loras)]

    plain = make_llm(str(tiny_llama_dir), **ENGINE)
    expected, base_only = run(plain, loras), run(plain, None)
    spec = make_llm(str(tiny_llama_dir), speculative_config=SPEC, **ENGINE)
    spec.engine_core.engine_core.scheduler.proposer = SpoilingOracle(
        [p["prompt_token_ids"] + out for p, out in zip(prompts, expected)])
    got = run(spec, loras)
    assert got == expected
    stats = spec.engine_core.engine_core.scheduler.spec_decoding_stats
    assert stats.num_drafts >= 40 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert all(n > 0 for n in stats.num_accepted_tokens_per_pos), stats
    # not vacuous: the adapter changes its requests' output, the base model's requests match
    changed = sum(expected[i] != base_only[i] for i in range(0, len(prompts), 2))
    assert changed >= 6, f"the adapter changed only {changed} of 8 outputs"
    assert all(expected[i] == base_only[i] for i in range(1, len(prompts), 2))


def test_negative_control_draft_rows_without_their_adapter_differ(make_llm, tiny_llama_dir, tmp_path,  # noqa: ANN001
                                                                 monkeypatch) -> None:
    """The equality above fails when a verification step's draft rows lose their request's slot
    (each request's first scheduled token keeps it, the drafts run the base model)."""
    import torch

    from lm_console.engine.models.lora import LoRAMapping
    from lm_console.engine.worker.lora_manager import LoRAManager
    from lm_console.kernels import lora_ops

    adapter = LoRARequest("noisy", 1, str(write_adapter(tmp_path / "noisy", rank=8, modules=MODULES, layers=2,
                                                        dims=DIMS)))
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(6, 40))]} for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = make_llm(str(tiny_llama_dir), **ENGINE)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False,
                                                                      lora_request=adapter)]
    real = LoRAManager.prepare_step

    def first_row_only(self, requests, num_scheduled):  # noqa: ANN001, ANN202
        mapping = real(self, requests, num_scheduled)
        if mapping is None or not 1 < max(num_scheduled) <= SPEC["num_speculative_tokens"] + 1:
            return mapping  # not a verification step (prompts are longer than 4 tokens)
        starts = torch.tensor([0] + num_scheduled[:-1]).cumsum(0)
        slots = torch.full_like(mapping.token_slots, -1)
        slots[starts] = mapping.token_slots[starts]
        return LoRAMapping(slots, mapping.scalings, lora_ops.slot_groups(slots))

    spec = make_llm(str(tiny_llama_dir), speculative_config=SPEC, **ENGINE)
    spec.engine_core.engine_core.scheduler.proposer = SpoilingOracle(
        [p["prompt_token_ids"] + out for p, out in zip(prompts, expected)])
    monkeypatch.setattr(LoRAManager, "prepare_step", first_row_only)
    got = [list(o.outputs[0].token_ids) for o in spec.generate(prompts, params, use_tqdm=False, lora_request=adapter)]
    assert sum(g != e for g, e in zip(got, expected)) >= 4
