"""Pooling: a prompt's embedding from the model's last hidden states (before the LM head).

LAST takes the hidden state of the prompt's last token; MEAN averages the hidden states of all
its tokens; then, if asked, the vector is L2-normalised (vLLM's pooling types and default).
A prompt's prefill may span several steps (chunked prefill): MEAN keeps a float32 running sum
per request across them, restarted when a preempted request recomputes from position 0. The
scheduler never lets a MEAN request skip prefix-cached tokens (their hidden states are needed).
"""

from __future__ import annotations

import torch

from lm_console.engine.worker.input_batch import CachedRequestState
from lm_console.engine.worker.step_inputs import StepInputs


class Pooler:
    """The runner's per-request pooling state; pool() returns the vectors finished this step."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def forget(self, req_id: str) -> None:
        self._sums.pop(req_id, None)

    def pool(self, hidden_states: torch.Tensor, inputs: StepInputs, states: list[CachedRequestState | None]
             ) -> dict[str, list[float]]:
        """Request id -> embedding, for each pooling request whose prompt completes this step."""
        result: dict[str, list[float]] = {}
        for row, req_id in enumerate(inputs.req_ids):
            state = states[row]
            if state is None or state.sampling_params.pooling is None:
                continue
            params = state.sampling_params.pooling
            num_prompt = len(state.prompt_token_ids)
            start = int(inputs.num_computed[row])
            if start >= num_prompt:
                continue  # decoding its one sampled token: the embedding went out already
            count = min(int(inputs.num_scheduled[row]), num_prompt - start)
            first = int(inputs.cu_num_tokens[row] - inputs.num_scheduled[row])
            rows = hidden_states[first:first + count].float()
            if params.pooling_type == "MEAN":
                partial = rows.sum(dim=0)
                if start > 0:
                    # The scheduler computes every prompt token of a MEAN request (no prefix cache,
                    # no KV loads), so its first chunk starts at 0.
                    assert req_id in self._sums, f"MEAN pooling of {req_id} began at position {start}, not 0"
                    partial = partial + self._sums[req_id]
                self._sums[req_id] = partial
            if start + count < num_prompt:
                continue
            if params.pooling_type == "MEAN":
                vector = self._sums.pop(req_id) / num_prompt
            else:
                vector = rows[-1]
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, p=2, dim=0)
            result[req_id] = vector.tolist()
        return result
