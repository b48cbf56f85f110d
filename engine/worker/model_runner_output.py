"""ModelRunnerOutput: what one step computed, as plain Python lists (seed: data flow)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.protocol import LogprobsLists


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per request (in req_ids order): the tokens sampled this step; [] for a partial prefill."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
