"""What one schedule() call decides: the step's running tally and a waiting request's admission."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lm_console.engine.request import Request

if TYPE_CHECKING:
    from lm_console.engine.core.kv_cache.manager import KVCacheBlocks
    from lm_console.engine.core.sched.encoder_scheduling import EncoderPlan


@dataclass(slots=True)
class _StepSchedule:
    """What one schedule() call has decided so far; its phases fill it in turn."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)  # admitted from WAITING this step
    cached_reqs: list[Request] = field(default_factory=list)  # RUNNING ones the worker holds
    new_block_ids: dict[str, tuple[list[int], ...] | None] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.token_budget -= num_new_tokens


@dataclass(slots=True)
class _Admission:
    """How a WAITING request would be admitted: its computed tokens, then what it schedules."""

    computed_blocks: KVCacheBlocks  # its prefix-cache hit
    num_local_tokens: int  # tokens of that hit
    num_external_tokens: int  # tokens a KV connector loads
    load_async: bool  # the load runs across steps: the request parks until it ends
    num_computed_tokens: int
    num_new_tokens: int = 0
    encoder_plan: EncoderPlan | None = None
