"""Prompt logprobs: the log-probability of every prompt token given the ones before it.

vLLM's semantics (the sampler's logprobs, applied to the prompt): position p's hidden
state predicts prompt token p + 1, so a prompt of P tokens has P - 1 rows (the first token has
none; the frontend puts None there). Each row holds the actual next token (its logprob and
1-based rank in the vocabulary) followed by the top `prompt_logprobs` tokens. Rows are computed
in the steps that compute their positions, so chunked prefill spreads them over several steps;
each chunk says where it starts, so that the scheduler can drop rows a recomputation after a
preemption produces a second time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lm_console.engine.protocol import LogprobsLists
from lm_console.engine.sample.logprobs import compute_logprobs_tensors
from lm_console.engine.worker.input_batch import CachedRequestState
from lm_console.engine.worker.step_inputs import StepInputs

# Rows of logits materialised at once: bounds the [rows, vocab] float32 temporaries.
_ROWS_PER_SLICE = 256

PromptLogprobsChunk = tuple[int, LogprobsLists]  # (first prompt position, its rows)


def compute_prompt_logprobs(
    hidden_states: torch.Tensor,
    inputs: StepInputs,
    states: list[CachedRequestState | None],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, PromptLogprobsChunk]:
    """This step's prompt-logprob rows of every request that asked for them.

    hidden_states: [num_tokens, hidden] of the step; states: the batch's rows in inputs order.
    """
    result: dict[str, PromptLogprobsChunk] = {}
    for row, req_id in enumerate(inputs.req_ids):
        state = states[row]
        if state is None or state.sampling_params.prompt_logprobs is None:
            continue
        num_prompt = len(state.prompt_token_ids)
        start = int(inputs.num_computed[row])
        # Positions whose next token is still a prompt token.
        end = min(start + int(inputs.num_scheduled[row]), num_prompt - 1)
        if end <= start:
            continue
        first_token = int(inputs.cu_num_tokens[row] - inputs.num_scheduled[row])
        targets = torch.tensor(state.prompt_token_ids[start + 1:end + 1], dtype=torch.int64,
                               device=hidden_states.device)
        num_logprobs = state.sampling_params.prompt_logprobs
        ids: list[list[int]] = []
        values: list[list[float]] = []
        ranks: list[int] = []
        for offset in range(0, end - start, _ROWS_PER_SLICE):
            stop = min(offset + _ROWS_PER_SLICE, end - start)
            hidden = hidden_states[first_token + offset:first_token + stop]
            logprobs = compute_logits(hidden).float().log_softmax(dim=-1)
            tensors = compute_logprobs_tensors(logprobs, targets[offset:stop], num_logprobs)
            ids.extend(tensors.logprob_token_ids.tolist())
            values.extend(tensors.logprobs.tolist())
            ranks.extend(tensors.selected_token_ranks.tolist())
        result[req_id] = (start, LogprobsLists(ids, values, ranks))
    return result
