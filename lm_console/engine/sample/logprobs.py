"""LogprobsTensors: the sampled token's logprob and rank plus the top-k, per row."""

from __future__ import annotations

from typing import NamedTuple

import torch

from lm_console.engine.protocol import LogprobsLists


class LogprobsTensors(NamedTuple):
    """Column 0 is the selected token, columns 1..k the top-k tokens (descending logprob)."""

    logprob_token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32
    selected_token_ranks: torch.Tensor  # [N] int64, 1-based rank of the selected token

    def tolists(self) -> LogprobsLists:
        """The Python-list form that crosses to the frontend (all rows)."""
        return LogprobsLists(
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
        )


def compute_logprobs_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor,
                             num_logprobs: int) -> LogprobsTensors:
    """Gather the selected tokens' logprobs and ranks, and the top `num_logprobs` per row.

    logprobs: [N, V] log-probabilities (log_softmax output); token_ids: [N] the selected tokens.
    Also serves prompt logprobs (token_ids = the next prompt tokens). The rank is 1 + the number
    of tokens with a strictly higher logprob, so an argmax token has rank 1 even when tied.
    """
    token_ids = token_ids.to(torch.int64)
    selected = logprobs.gather(-1, token_ids.unsqueeze(-1))  # [N, 1]
    ranks = (logprobs > selected).sum(-1) + 1  # [N]
    k = min(num_logprobs, logprobs.shape[-1])
    if k > 0:
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [N, k], sorted descending
        ids = torch.cat([token_ids.unsqueeze(-1), top_ids], dim=-1)
        values = torch.cat([selected, top_logprobs], dim=-1)
    else:
        ids, values = token_ids.unsqueeze(-1), selected
    return LogprobsTensors(ids, values.to(torch.float32), ranks)
