"""The Sampler's logits transforms, each in place on [B, V] float32 logits.

Each op touches only what it must; the Sampler skips an op when no row needs it.
"""

from __future__ import annotations

from typing import Callable

import torch

from lm_console.engine.sample.metadata import SamplingMetadata
from lm_console.kernels import cpu_sampling

_NEG_INF = float("-inf")
# Top-p first looks for the nucleus among this many top tokens (a topk is far cheaper than a
# full-vocab sort); rows whose nucleus is wider fall back to the sort.
_TOP_P_NUM_CANDIDATES = 1024


def apply_allowed_token_ids(logits: torch.Tensor, disallowed: tuple[torch.Tensor, torch.Tensor]) -> None:
    """-inf for every token a row with allowed_token_ids did not list."""
    rows, mask = disallowed
    if mask.shape[1] != logits.shape[1]:
        # Columns past the vocabulary (a padded output layer) are not tokens: never allowed either.
        full = torch.ones((rows.shape[0], logits.shape[1]), dtype=torch.bool, device=logits.device)
        width = min(mask.shape[1], logits.shape[1])
        full[:, :width] = mask[:, :width]
        mask = full
    if rows.shape[0] == logits.shape[0]:  # every row restricts (rows are 0..B-1 in order): in place
        logits.masked_fill_(mask, _NEG_INF)
    else:
        logits[rows] = logits[rows].masked_fill_(mask, _NEG_INF)


def apply_logit_bias(logits: torch.Tensor, logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Add each row's biases to its tokens' logits (one scatter for the whole batch)."""
    rows, token_ids, biases = logit_bias
    logits.index_put_((rows, token_ids), biases, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Stop tokens -> -inf for rows that have generated fewer than min_tokens tokens."""
    rows: list[int] = []
    cols: list[int] = []
    vocab_size = logits.shape[1]
    for row, (min_tokens, stop_token_ids) in metadata.min_tokens.items():
        if len(metadata.output_token_ids[row]) < min_tokens:
            ids = [t for t in stop_token_ids if t < vocab_size]
            rows.extend([row] * len(ids))
            cols.extend(ids)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits.index_put_(index, torch.tensor(_NEG_INF, device=logits.device))


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Repetition (tokens in prompt or output), then frequency and presence (output counts).

    Works on the seen token ids only (gather / scatter), never on dense [B, V] masks: a row
    sees far fewer tokens than the vocabulary holds.
    """
    vocab_size = logits.shape[1]
    output_ids = _pad_rows(metadata.output_token_ids, vocab_size, logits.device)  # [B, L]
    repetition = metadata.repetition_penalties
    if repetition is not None:
        seen_ids = output_ids
        if metadata.prompt_token_ids is not None:
            seen_ids = torch.cat([metadata.prompt_token_ids, output_ids], dim=1)
        penalty = repetition.unsqueeze(1)  # [B, 1]
        _update_seen(logits, seen_ids,
                     lambda seen: torch.where(seen > 0, seen / penalty, seen * penalty))
    if metadata.frequency_penalties is not None and output_ids.shape[1]:
        valid = output_ids < vocab_size
        weights = -metadata.frequency_penalties.unsqueeze(1) * valid  # [B, L]; 0 on padding
        logits.scatter_add_(1, output_ids.clamp(max=vocab_size - 1), weights)
    if metadata.presence_penalties is not None:
        presence = metadata.presence_penalties.unsqueeze(1)  # [B, 1]
        _update_seen(logits, output_ids, lambda seen: seen - presence)


def _pad_rows(token_ids: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = [list(ids) + [pad_id] * (max_len - len(ids)) for ids in token_ids]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(token_ids), max_len)


def _update_seen(logits: torch.Tensor, token_ids: torch.Tensor,
                 update: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """logits[row, t] = update(logits[row, t]) once for each distinct t of the row.

    token_ids: [B, N] padded with vocab_size. Padding and repeats are pointed at a real id of
    the row, so every write to one place carries the same value (scatter_ stays well-defined).
    """
    num_rows, vocab_size = logits.shape
    if token_ids.shape[1] == 0:
        return
    valid = token_ids < vocab_size  # [B, N]
    row_has_ids = valid.any(dim=1, keepdim=True)  # [B, 1]
    first = token_ids.gather(1, valid.to(torch.uint8).argmax(dim=1, keepdim=True))  # [B, 1]
    index = torch.where(valid, token_ids, first)
    index = torch.where(row_has_ids, index, torch.zeros_like(index))
    current = logits.gather(1, index)  # [B, N]
    updated = torch.where(row_has_ids, update(current), current)
    logits.scatter_(1, index, updated)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p times the row's top probability.

    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p), so no softmax is needed.
    """
    threshold = logits.amax(dim=1) + torch.log(min_p)  # [B]; -inf where min_p == 0
    logits.masked_fill_(logits < threshold.unsqueeze(1), _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> None:
    """Keep the top_k tokens, then the smallest top set whose probability reaches top_p.

    Each row gets one logit cut-off; tokens tied with the cut-off are kept. top_k rows without
    top-k hold vocab_size; top_p rows without top-p hold 1.0.
    """
    num_rows, vocab_size = logits.shape
    has_k = top_k < vocab_size if top_k is not None else None  # [B] bool
    has_p = top_p < 1.0 if top_p is not None else None  # [B] bool
    max_k = int(top_k[has_k].max()) if has_k is not None and bool(has_k.any()) else 0
    num_candidates = max_k
    if has_p is not None and bool(has_p.any()):
        if has_k is None or not bool((has_k | ~has_p).all()):
            num_candidates = max(max_k, _TOP_P_NUM_CANDIDATES)
    num_candidates = min(num_candidates, vocab_size)
    if num_candidates == 0:
        return
    values = logits.topk(num_candidates, dim=1).values  # [B, C] descending
    cutoff = torch.full((num_rows,), _NEG_INF, device=logits.device)  # [B]
    if has_k is not None:
        k = top_k.clamp(max=num_candidates)
        kth = values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        cutoff = torch.where(has_k, kth, cutoff)
        beyond_k = torch.arange(num_candidates, device=logits.device).unsqueeze(0) >= k.unsqueeze(1)
        values = values.masked_fill(beyond_k & has_k.unsqueeze(1), _NEG_INF)
    if has_p is not None:
        # Probabilities of the candidates: renormalised over the top-k for top-k rows, over
        # the whole vocabulary otherwise.
        norm = values.logsumexp(dim=1) if has_k is not None else None  # [B]
        if has_k is None or bool((has_p & ~has_k).any()):
            full_norm = logits.logsumexp(dim=1)
            norm = full_norm if has_k is None else torch.where(has_k, norm, full_norm)
        assert norm is not None
        probs = (values - norm.unsqueeze(1)).exp()  # [B, C]
        mass_before = probs.cumsum(dim=1) - probs
        num_keep = (mass_before < top_p.unsqueeze(1)).sum(dim=1).clamp(min=1)
        if has_k is not None:
            num_keep = torch.where(has_k, num_keep.clamp(max=top_k.clamp(max=num_candidates)),
                                   num_keep)
        p_cut = values.gather(1, (num_keep - 1).unsqueeze(1)).squeeze(1)
        covered = mass_before[:, -1] + probs[:, -1] >= top_p
        if has_k is not None:
            covered |= has_k
        cutoff = torch.where(has_p & covered, torch.maximum(cutoff, p_cut), cutoff)
        wide = (has_p & ~covered).nonzero().squeeze(1)
        if wide.numel():
            cutoff[wide] = _top_p_cutoff_by_sort(logits[wide], top_p[wide])
    logits.masked_fill_(logits < cutoff.unsqueeze(1), _NEG_INF)


def _row_keys(num_rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """[B] int64: a fresh random key per row, from the row's generator where it has one."""
    keys = torch.empty(num_rows, dtype=torch.int64)
    if len(generators) < num_rows:
        keys.random_()
    for row, generator in generators.items():
        keys[row : row + 1].random_(generator=generator)
    return keys


def _top_p_cutoff_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The top-p logit cut-off of each row by a full sort (rows with a wide nucleus)."""
    values = logits.sort(dim=1, descending=True).values  # [R, V]
    probs = values.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs
    num_keep = (mass_before < top_p.unsqueeze(1)).sum(dim=1).clamp(min=1)
    return values.gather(1, (num_keep - 1).unsqueeze(1)).squeeze(1)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [B] int64 (the first maximum): the C kernel on the CPU (vectorised, rows
    over the threads; torch's argmax took ~0.4 ms for 29 rows of a 49k vocabulary), else torch."""
    if cpu_sampling.supports(logits) and logits.shape[1] > 0:
        return cpu_sampling.argmax(logits)
    return logits.argmax(dim=-1)


def random_sample(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row by the exponential race: argmax(p / q), q ~ Exp(1).

    On the CPU the C kernel hashes each row's V noise values from one key per row and step:
    seeded rows draw their key from their own generator (one draw a step whatever the batch),
    the others from the default generator. Elsewhere, q = -log(u) with u ~ U[0, 1) drawn the
    same way but V values at a time. p needs no normalisation.
    """
    if cpu_sampling.supports(logits):
        return cpu_sampling.exponential_race(logits, _row_keys(logits.shape[0], generators))
    probs = logits.sub_(logits.amax(dim=1, keepdim=True)).exp_()  # [B, V], unnormalised, in place
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.uniform_()
    for row, generator in generators.items():
        q[row].uniform_(generator=generator)
    # Exp(1). u = 0 gives q = inf: that token cannot win. The floor keeps q > 0 even if a
    # backend's uniform_ ever returns 1.0, so a masked token (p = 0) never meets 0 / 0 = NaN.
    q.log_().neg_().clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=1)
