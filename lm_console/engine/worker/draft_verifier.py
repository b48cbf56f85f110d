"""Speculative decoding's verification on the worker: the rejection sampler over the rows of a
step that verified drafts.

A request with d drafts has d + 1 logits rows in the step (its real token, then each draft).
Row j is judged as if the first j drafts had been emitted: the grammar's bitmask row for that
position, and sampling metadata (penalties, min_tokens) over the output plus those drafts. The
rejection sampler then keeps the longest accepted prefix and adds the target's own token
(lm_console/engine/sample/rejection_sampler.py). The model runner appends what comes back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lm_console.engine.protocol import LogprobsLists
from lm_console.engine.sample.grammar_bitmask import apply_grammar_bitmask
from lm_console.engine.sample.metadata import SamplingMetadata
from lm_console.engine.sample.rejection_sampler import RejectionSampler
from lm_console.engine.worker.input_batch import CachedRequestState


class DraftVerifier:
    """Turns a verification step's logits into each request's emitted tokens (and logprobs)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.rejection_sampler = RejectionSampler()
        self.vocab_size = vocab_size
        self.device = device

    def verify(self, logits: torch.Tensor, req_ids: list[str], drafts: list[list[int]],
               requests: dict[str, CachedRequestState], grammar_bitmask: np.ndarray | None,
               structured_ids: list[str] | None) -> tuple[list[list[int]], dict[str, LogprobsLists]]:
        """(each request's emitted tokens, in req_ids order; the logprobs of those that asked)."""
        if grammar_bitmask is not None:
            # A structured request's bitmask rows cover its len(drafts) + 1 logits rows, in order.
            first_rows: dict[str, tuple[int, int]] = {}
            row = 0
            for req_id, request_drafts in zip(req_ids, drafts):
                first_rows[req_id] = (row, len(request_drafts) + 1)
                row += len(request_drafts) + 1
            apply_grammar_bitmask(logits, grammar_bitmask,
                                  [first + j for req_id in structured_ids or []
                                   for first, count in (first_rows[req_id],) for j in range(count)])
        output = self.rejection_sampler(logits, self._metadata(req_ids, drafts, requests), drafts)
        logprobs: dict[str, LogprobsLists] = {}
        if output.logprobs_tensors is not None:
            lists = output.logprobs_tensors.tolists()
            emitted = 0
            for req_id, tokens in zip(req_ids, output.token_ids):
                num_logprobs = requests[req_id].sampling_params.logprobs
                if num_logprobs is not None:
                    rows, width = slice(emitted, emitted + len(tokens)), num_logprobs + 1
                    logprobs[req_id] = LogprobsLists([ids[:width] for ids in lists.logprob_token_ids[rows]],
                                                     [values[:width] for values in lists.logprobs[rows]],
                                                     lists.sampled_token_ranks[rows])
                emitted += len(tokens)
        return output.token_ids, logprobs

    def _metadata(self, req_ids: list[str], drafts: list[list[int]],
                  requests: dict[str, CachedRequestState]) -> SamplingMetadata:
        """SamplingMetadata with one row per verification row: row j of a request sees its
        output plus its first j drafts (penalties, min_tokens); its generator sits on its first row."""
        params: list[Any] = []
        outputs, prompts = [], []
        generators: dict[int, torch.Generator] = {}
        for req_id, request_drafts in zip(req_ids, drafts):
            req_state = requests[req_id]
            if req_state.generator is not None:
                generators[len(params)] = req_state.generator
            for j in range(len(request_drafts) + 1):
                params.append(req_state.sampling_params)
                outputs.append(req_state.output_token_ids + request_drafts[:j] if j else req_state.output_token_ids)
                prompts.append(req_state.prompt_token_ids)
        return SamplingMetadata.from_params(params, outputs, prompts, generators, self.vocab_size, self.device)
