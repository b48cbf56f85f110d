"""StructuredOutputManager: compiles requests' grammars off the step and fills the step's bitmask.

Lives in the engine core. A structured request is admitted in WAITING_FOR_FSM while a small
thread pool compiles its constraint; the scheduler admits it once the grammar is ready (or
fails that one request if it does not compile). Each step, the manager fills one token bitmask
row for every structured request that samples a token; the worker masks those logits rows
before sampling (lm_console/engine/sample/grammar_bitmask.py), and the scheduler advances each matcher on
the tokens it accepts. The scheduler reports the structured requests it takes in and frees, so
a step skips the bitmask scan when the engine holds none.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from lm_console.engine.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.request import Request
    from lm_console.engine.scheduler_output import SchedulerOutput
    from lm_console.engine.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar

logger = logging.getLogger(__name__)

__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]


class StructuredOutputManager:
    """Grammar compiles on a thread pool; one bitmask for the batch each step.

    The backend (tokenizer vocabulary, compiler) is built on first use, in the pool, so an
    engine that never sees a structured request pays nothing for it.

    Invariant: num_structured_requests is the number of requests with a structured output in
    the scheduler (added, not yet freed).
    """

    def __init__(self, config: EngineConfig) -> None:
        self._tokenizer_dir = config.model_config.tokenizer_dir
        self._vocab_size = config.model_config.vocab_size
        backend = config.structured_outputs_config.backend
        if backend != "xgrammar":
            raise ValueError(f"structured outputs backend {backend!r} is not supported; use 'xgrammar'.")
        self._num_threads = max(1, min(2, (os.cpu_count() or 2) // 2))
        self._executor: ThreadPoolExecutor | None = None
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pending: set[Future[XgrammarGrammar]] = set()
        self.num_structured_requests = 0

    # -- compile --------------------------------------------------------------------------
    def grammar_init(self, request: Request) -> None:
        """Start compiling a structured request's grammar; it waits in WAITING_FOR_FSM meanwhile."""
        from lm_console.engine.request import RequestStatus

        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self._num_threads, thread_name_prefix="lmc-grammar")
        kind, spec = params.grammar_key()
        stop_token_ids = [request.eos_token_id] if request.eos_token_id is not None else None
        future = self._executor.submit(self._compile, kind, spec, stop_token_ids)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        request.structured_output_request = StructuredOutputRequest(params, future)
        request.status = RequestStatus.WAITING_FOR_FSM

    def _compile(self, kind: str, spec: str, stop_token_ids: list[int] | None) -> XgrammarGrammar:
        return self._get_backend().compile(kind, spec, stop_token_ids)

    def _get_backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                from lm_console.engine.structured_output.backend_xgrammar import XgrammarBackend

                self._backend = XgrammarBackend(self._tokenizer_dir, self._vocab_size, self._num_threads)
            return self._backend

    def has_pending_compiles(self) -> bool:
        return bool(self._pending)

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block until a pending compile ends or timeout_s passes (a step with nothing else to do)."""
        pending = list(self._pending)
        if pending:
            wait(pending, timeout=timeout_s, return_when="FIRST_COMPLETED")

    # -- the scheduler's structured requests ---------------------------------------------------
    def add_request(self, request: Request) -> None:
        """The scheduler took `request` in: count it if it is structured."""
        if request.structured_output_request is not None:
            self.num_structured_requests += 1

    def finish_request(self, request: Request) -> None:
        """The scheduler freed `request` (finished, aborted or failed): uncount it if it is structured."""
        if request.structured_output_request is not None:
            self.num_structured_requests -= 1
            assert self.num_structured_requests >= 0, request.request_id

    def has_structured_requests(self) -> bool:
        """Whether a step may need a bitmask (a structured request is in the scheduler)."""
        return self.num_structured_requests > 0

    # -- the step's bitmask -------------------------------------------------------------------
    def add_grammar_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Put on the step's output the structured requests that sample a token this step (in
        step order; a prompt chunk that does not finish its prompt samples nothing) and their
        bitmask rows: [num_ids, ceil(vocab / 32)] int32, bit t of row i set if the i-th request's
        grammar allows token t next. Runs before the scheduler advances num_computed_tokens."""
        req_ids, grammars = [], []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            so_request = request.structured_output_request
            if (so_request is not None and so_request.grammar is not None
                    and request.num_computed_tokens + num_tokens >= request.num_tokens):
                req_ids.append(req_id)
                grammars.append(so_request.grammar)
        if not req_ids:
            return
        backend = self._get_backend()
        bitmask = backend.allocate_bitmask(len(grammars))
        backend.fill_bitmask(grammars, bitmask)
        scheduler_output.structured_output_request_ids = req_ids
        scheduler_output.grammar_bitmask = bitmask

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
