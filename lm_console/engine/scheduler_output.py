"""SchedulerOutput and its per-request diffs (after vLLM's vllm/v1/core/sched/output.py).

The core's scheduler produces it and the executor hands it to every worker, so it lives at the
bottom, below both, and imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_console.engine.lora.request import LoRARequest
    from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec
    from lm_console.engine.request import Request
    from lm_console.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """Everything the worker needs the first time it sees a request (or after a preemption).

    output_token_ids is non-empty only for a request resumed after preemption: the worker
    rebuilds the same state (penalties, seeds) it had before.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    mm_features: list[MultiModalFeatureSpec]
    lora_request: LoRARequest | None = None  # its adapter (the worker loads it on first sight)

    @classmethod
    def from_request(cls, request: Request, block_ids: tuple[list[int], ...]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            mm_features=request.mm_features,
            lora_request=request.lora_request,
        )


@dataclass(slots=True)
class CachedRequestData:
    """Diffs for requests the worker already holds: new blocks and progress, one list per field."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """The result of one Scheduler.schedule() call: what the worker computes this step."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    num_common_prefix_blocks: tuple[int, ...] = ()
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # Multimodal (lm_console/engine/core/sched/encoder_scheduling.py): request id -> mm input ids to encode
    # this step, and the ECConnector's per-step metadata.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    ec_connector_metadata: Any = None
    kv_connector_metadata: Any = None  # KVConnectorMetadata from the scheduler-side connector
    # Structured outputs: the requests that sample under a grammar this step, and their rows of
    # the token bitmask (int32 numpy [len(ids), ceil(vocab / 32)]; bit t set: token t allowed).
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # Speculative decoding: request id -> the draft tokens it verifies this step (scheduled
    # after its one real token; num_scheduled_tokens counts them). Absent: no drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
