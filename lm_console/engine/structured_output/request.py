"""StructuredOutputRequest: one request's constraint, its grammar compile and its matcher.

Torch-free (the scheduler touches it): the grammar object comes from the backend
(backend_xgrammar.py) through a Future the manager's thread pool completes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lm_console.engine.request import RequestStatus

if TYPE_CHECKING:
    from lm_console.engine.sampling_params import StructuredOutputsParams
    from lm_console.engine.structured_output.backend_xgrammar import XgrammarGrammar


@dataclass(slots=True)
class StructuredOutputRequest:
    """The structured-output state of one request.

    Invariant: once `grammar` is set, its matcher has accepted exactly the request's output
    tokens (the scheduler advances it in update_from_output); it survives preemption, since
    the recomputed tokens were accepted already.
    """

    params: StructuredOutputsParams
    future: Future[XgrammarGrammar] | None = None
    grammar: XgrammarGrammar | None = None
    # Why the constraint did not compile: (engine.errors class name, message) for the frontend.
    error: tuple[str, str] | None = None
    deadline: float | None = None  # time.monotonic() by which the compile must finish (set when it starts)
    timeout_s: float = 0.0
    on_give_up: Callable[[Future], None] | None = None  # the manager's: the compile is no longer awaited

    def is_grammar_ready(self) -> bool:
        """Whether the compile has finished (successfully: grammar set; or not: compile_error set)."""
        if self.grammar is not None or self.error is not None:
            return True
        future = self.future
        if future is None:
            return False
        if not future.done():
            if self.deadline is None or time.monotonic() < self.deadline:
                return False
            self.future = None
            if self.on_give_up is not None:
                self.on_give_up(future)
            self.error = ("InvalidStructuredOutputError",
                          f"the structured output constraint ({self.params.kind}) did not compile within "
                          f"{self.timeout_s:g} s; use a simpler or smaller constraint")
            return True
        self.future = None
        if future.cancelled():
            self.error = ("InvalidStructuredOutputError", "the structured output compile was cancelled")
        elif (error := future.exception()) is None:
            self.grammar = future.result()
        else:
            reason = str(error).strip() or type(error).__name__
            self.error = ("InvalidStructuredOutputError",
                          f"the structured output constraint ({self.params.kind}) does not compile: {reason}")
        return True

    def accept_token(self, token_id: int) -> tuple[RequestStatus, tuple[str, str] | None] | None:
        """Advance the matcher over one sampled token. None: the request goes on; else how it
        ends: FINISHED_STOPPED (the grammar is complete), or FINISHED_ABORTED with an error (the
        grammar refused the token, which its bitmask should have masked: an engine bug)."""
        grammar = self.grammar
        if grammar is None:
            return None
        if not grammar.accept_token(token_id):
            return RequestStatus.FINISHED_ABORTED, (
                "RequestRejectedError", f"structured output: the grammar refused sampled token {token_id} after "
                f"{grammar.num_processed_tokens} accepted tokens (an engine bug).")
        if grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED, None
        return None
