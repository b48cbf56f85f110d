"""StructuredOutputManager: compiles requests' grammars off the step and fills the step's bitmask.

Lives in the engine core. A structured request is admitted in WAITING_FOR_FSM while its
constraint compiles in a thread of its own; at most a few compile at once (the compile slots).
The scheduler admits it once the grammar is ready, or fails that one request if it does not
compile or is still compiling after compile_timeout_s. xgrammar cannot interrupt a compile, so
a timed-out (or aborted) compile gives its slot back at once and finishes unobserved: other
requests' compiles never wait behind it, and a constraint that compiled before (json_object, a
schema a client repeats) skips the slots altogether. At most MAX_ABANDONED such compiles may run at once;
past that, new structured requests are refused until they end. The compiled grammars are cached
up to cache_bytes. Each step, the manager fills one token bitmask
row for every structured request that samples a token; the worker masks those logits rows
before sampling (lm_console/engine/sample/grammar_bitmask.py), and the scheduler advances each matcher on
the tokens it accepts. The scheduler reports the structured requests it takes in and frees, so
a step skips the bitmask scan when the engine holds none.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING

from lm_console.engine.platform import usable_cpus
from lm_console.engine.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.request import Request
    from lm_console.engine.scheduler_output import SchedulerOutput
    from lm_console.engine.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar

logger = logging.getLogger(__name__)

__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]

MAX_ABANDONED = 4  # timed-out or aborted compiles still running; past this, new constraints are refused
MAX_KNOWN = 1024  # constraints that compiled before (hashes): they compile without waiting for a slot


class StructuredOutputManager:
    """Grammar compiles in bounded threads; one bitmask for the batch each step.

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
        self._num_threads = max(1, min(2, usable_cpus() // 2))
        self._timeout_s = config.structured_outputs_config.compile_timeout_s
        self._cache_bytes = config.structured_outputs_config.cache_bytes
        self._num_slots = max(2, self._num_threads)
        self._slots = threading.Semaphore(self._num_slots)
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the three sets below and the known hashes
        self._pending: set[Future[XgrammarGrammar]] = set()
        self._holders: set[Future[XgrammarGrammar]] = set()  # compiles holding a slot
        self._abandoned: set[Future[XgrammarGrammar]] = set()  # running, but nobody waits for them
        # Hashes of constraints that compiled before: xgrammar likely has them cached, and they
        # compiled in bounded time once, so they skip the slots (a json_object request never
        # waits behind a stranger's slow compile).
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self.num_abandoned = 0
        self.num_structured_requests = 0

    # -- compile --------------------------------------------------------------------------
    def grammar_init(self, request: Request) -> None:
        """Start compiling a structured request's grammar; it waits in WAITING_FOR_FSM meanwhile."""
        from lm_console.engine.request import RequestStatus

        params = request.sampling_params.structured_outputs
        if params is None:
            return
        kind, spec = params.grammar_key()
        stop_token_ids = [request.eos_token_id] if request.eos_token_id is not None else None
        future: Future[XgrammarGrammar] = Future()
        so_request = StructuredOutputRequest(params, future, timeout_s=self._timeout_s, on_give_up=self.give_up)
        request.structured_output_request = so_request
        request.status = RequestStatus.WAITING_FOR_FSM
        if self.num_abandoned >= MAX_ABANDONED:
            future.set_exception(RuntimeError(
                f"the grammar compiler is busy with {self.num_abandoned} constraints that did not compile in "
                "time; retry later with a simpler constraint"))
            return
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        key = hashlib.sha256(f"{kind}\0{spec}".encode("utf-8", "surrogatepass")).digest()
        with self._lock:
            known = key in self._known
        threading.Thread(target=self._run, args=(so_request, future, kind, spec, stop_token_ids, key, known),
                         name="lmc-grammar", daemon=True).start()

    def _run(self, so_request: StructuredOutputRequest, future: Future[XgrammarGrammar], kind: str, spec: str,
             stop_token_ids: list[int] | None, key: bytes, known: bool) -> None:
        """One compile: wait for a slot (unless the constraint is known), compile, hand the result
        over (in its own thread)."""
        if not known:
            self._slots.acquire()
        with self._lock:  # with give_up(): a compile is either cancelled, or running and counted
            started = future.set_running_or_notify_cancel()
            if started and not known:
                self._holders.add(future)
        if not started:  # cancelled while it waited for a slot
            if not known:
                self._slots.release()
            return
        # The deadline runs from the compile's start: time spent waiting for a slot is bounded by
        # the deadlines of the compiles ahead of it, and is no fault of this constraint.
        so_request.deadline = time.monotonic() + self._timeout_s
        try:
            result = self._get_backend().compile(kind, spec, stop_token_ids)
        except BaseException as error:  # noqa: BLE001 - the request's error, not the thread's
            future.set_exception(error)
        else:
            with self._lock:
                self._known[key] = None
                self._known.move_to_end(key)
                while len(self._known) > MAX_KNOWN:
                    self._known.popitem(last=False)
            future.set_result(result)
        finally:
            with self._lock:
                held = future in self._holders
                self._holders.discard(future)
                if future in self._abandoned:
                    self._abandoned.discard(future)
                    self.num_abandoned -= 1
            if held:
                self._slots.release()

    def give_up(self, future: Future[XgrammarGrammar]) -> None:
        """Nobody waits for this compile any more (timed out, or its request ended): a queued one
        is cancelled; a running one gives its slot back and finishes unobserved."""
        if future.cancel():
            return
        with self._lock:
            if future.done() or future in self._abandoned:
                return
            self._abandoned.add(future)
            self.num_abandoned += 1
            held = future in self._holders
            self._holders.discard(future)
        if held:
            self._slots.release()
        self._pending.discard(future)

    def _get_backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                from lm_console.engine.structured_output.backend_xgrammar import XgrammarBackend

                self._backend = XgrammarBackend(self._tokenizer_dir, self._vocab_size, self._num_threads,
                                                cache_bytes=self._cache_bytes)
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
        so_request = request.structured_output_request
        if so_request is not None:
            self.num_structured_requests -= 1
            assert self.num_structured_requests >= 0, request.request_id
            if so_request.future is not None and not so_request.future.done():
                self.give_up(so_request.future)  # aborted while compiling: the client has left

    def has_structured_requests(self) -> bool:
        """Whether a step may need a bitmask (a structured request is in the scheduler)."""
        return self.num_structured_requests > 0

    # -- the step's bitmask -------------------------------------------------------------------
    def add_grammar_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Put on the step's output the structured requests that sample a token this step (in
        step order; a prompt chunk that does not finish its prompt samples nothing) and their
        bitmask rows: [num_rows, ceil(vocab / 32)] int32, bit t of a row set if the grammar allows
        token t there. A request has one row per token the step samples for it: one, or with
        speculative drafts len(drafts) + 1 (next, then after each draft), in that order. Runs
        before the scheduler advances num_computed_tokens."""
        req_ids, grammars, drafts = [], [], []
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            so_request = request.structured_output_request
            if (so_request is not None and so_request.grammar is not None
                    and request.num_computed_tokens + num_tokens >= request.num_tokens):
                req_ids.append(req_id)
                grammars.append(so_request.grammar)
                drafts.append(spec.get(req_id, []))
        if not req_ids:
            return
        backend = self._get_backend()
        bitmask = backend.allocate_bitmask(len(grammars) + sum(len(d) for d in drafts))
        backend.fill_bitmask(grammars, drafts, bitmask)
        scheduler_output.structured_output_request_ids = req_ids
        scheduler_output.grammar_bitmask = bitmask

    def shutdown(self) -> None:
        for future in list(self._pending):  # compiles still queued for a slot never start
            future.cancel()
