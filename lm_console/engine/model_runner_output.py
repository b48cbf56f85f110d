"""ModelRunnerOutput: what one step computed, as plain Python lists.

The worker produces it and the core's scheduler consumes it, so it lives at the bottom, below
both, and imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lm_console.engine.protocol import LogprobsLists

if TYPE_CHECKING:
    from lm_console.engine.distributed.kv_transfer.output import KVConnectorOutput


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per request (in req_ids order): the tokens sampled this step; [] for a partial prefill."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
    # Prompt logprobs computed this step: request id -> (first prompt position, its rows).
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)
    # Embeddings of the pooling requests whose prompt completed this step (worker/pooling.py).
    pooler_output: dict[str, list[float]] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
