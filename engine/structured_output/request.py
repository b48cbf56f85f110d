"""StructuredOutputRequest: one request's constraint, its grammar compile and its matcher.

Torch-free (the scheduler touches it): the grammar object comes from the backend
(backend_xgrammar.py) through a Future the manager's thread pool completes.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampling_params import StructuredOutputsParams
    from engine.structured_output.backend_xgrammar import XgrammarGrammar


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
    compile_error: str | None = None  # why the constraint did not compile
    _done: bool = field(default=False, repr=False)

    def is_grammar_ready(self) -> bool:
        """Whether the compile has finished (successfully: grammar set; or not: compile_error set)."""
        if self._done:
            return True
        future = self.future
        if future is None or not future.done():
            return False
        self._done, self.future = True, None
        error = future.exception()
        if error is None:
            self.grammar = future.result()
        else:
            self.compile_error = str(error).strip() or type(error).__name__
        return True
