"""Paged attention in plain torch (TorchAttentionBackend), and with the C kernels (CpuAttentionBackend).

One step's batch is split once into decode rows (query_len == 1) and prefill chunks; the split
(a `_Plan`) is stored on the step's TorchAttentionMetadata and reused by every layer:
- decodes: with the C kernel (lm_console/kernels/cpu_attention.py, bf16 and fp32), one call per
  layer reads every decode row's K/V in place from the paged cache. Without it, rows are
  bucketed by context length; each bucket's K/V blocks are gathered into one padded tensor and
  attended with two batched matmuls; grouped-query heads ride along the query axis, so K/V are
  never repeated;
- prefill chunks: with the C kernel, one call for all chunks, reading K/V (the chunk's own,
  just written, and any cached context) in place. Without it, one SDPA call each; `is_causal` when the chunk has no cached context (K/V come
  straight from the input), an explicit bottom-right-aligned causal mask over the gathered
  context otherwise.
An int8 cache (lm_console/engine/attention/int8_cache.py) is read through the same kernels; on the torch
path its rows are dequantized as they are gathered, and a chunk without cached context attends
to its own K/V as the cache holds them (round_trip), so both paths see the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from lm_console.engine.attention import int8_cache
from lm_console.engine.attention.backend import AttentionBackend
from lm_console.engine.attention.metadata import AttentionMetadata
from lm_console.engine.attention.sdpa import _causal_allowed, _sdpa
from lm_console.kernels import cpu_attention


def reshape_and_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write key/value rows into their cache slots; rows whose slot is -1 are skipped.

    key, value: [num_tokens, num_kv_heads, head_dim] or [num_tokens, num_kv_heads * head_dim];
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping: [num_tokens].
    """
    num_tokens = slot_mapping.shape[0]
    slots = slot_mapping.long().contiguous()  # the C writer reads a plain int64 vector
    valid = slots >= 0
    token_idx = None
    if not bool(valid.all()):
        token_idx = valid.nonzero().squeeze(1)
        slots = slots[token_idx]
    _write_cache(key[:num_tokens], value[:num_tokens], kv_cache, slots, token_idx)


def _write_cache(
    key: Tensor, value: Tensor, kv_cache: Tensor, slots: Tensor, token_idx: Tensor | None
) -> None:
    """kv_cache[0/1] slot rows <- key/value rows (all rows, or those at token_idx)."""
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    num_kv_heads = kv_cache.shape[3]
    row = num_kv_heads * cpu_attention.cache_head_dim(kv_cache)
    key = key.reshape(key.shape[0], row)  # [num_tokens, num_kv_heads * head_dim]
    value = value.reshape(value.shape[0], row)
    if token_idx is None and cpu_attention.supports_cache_write(key, value, kv_cache):
        cpu_attention.reshape_and_cache(key, value, kv_cache, slots)
        return
    if token_idx is not None:
        key, value = key[token_idx], value[token_idx]
    if kv_cache.dtype == torch.int8:
        key = int8_cache.quantize_rows(key, num_kv_heads).view(key.shape[0], -1)
        value = int8_cache.quantize_rows(value, num_kv_heads).view(value.shape[0], -1)
    width = kv_cache.shape[3] * kv_cache.shape[4]
    kv_cache[0].view(num_slots, width).index_copy_(0, slots, key)
    kv_cache[1].view(num_slots, width).index_copy_(0, slots, value)


@dataclass(slots=True)
class _Prefill:
    """One request's chunk of more than one new token."""

    q_start: int
    q_end: int
    num_context: int  # tokens already in the cache before this chunk
    seq_len: int
    block_ids: Tensor | None  # [num_blocks] int64; None when num_context == 0 (no gather)
    req_index: int = -1  # the request's row in the batch (its block table row)
    masks: dict[int | None, Tensor | None] = field(default_factory=dict)  # window -> allowed
    spans: list[tuple[int, int]] | None = None  # bidirectional position spans (images, Gemma3)


@dataclass(slots=True)
class _DecodeGroup:
    """Decode rows attended together, their K/V gathered into one padded tensor."""

    token_idx: Tensor | None  # [B] int64 rows of q; None = the first B tokens, in order
    block_ids: Tensor  # [B * num_blocks] int64 (entries past a row's blocks point at block 0)
    num_blocks: int
    seq_lens: list[int]
    seq_lens_t: Tensor  # [B, 1] int64
    blocked: dict[int | None, Tensor | None] = field(default_factory=dict)  # window -> mask


@dataclass(slots=True)
class _DecodeRows:
    """All decode rows of a step, as the C kernel takes them."""

    token_idx: Tensor | None  # [num_decodes] int64 rows of q; None = the first rows, in order
    block_table: Tensor  # [num_decodes, max_blocks] int32, contiguous
    seq_lens: Tensor  # [num_decodes] int32


@dataclass(slots=True)
class _PrefillRows:
    """All prefill chunks of a step, as the C kernel takes them (int32 tensors)."""

    block_table: Tensor  # [num_chunks, max_blocks]
    q_starts: Tensor  # [num_chunks]
    q_lens: Tensor
    seq_lens: Tensor


@dataclass(slots=True)
class _Plan:
    """How one step's batch is attended; built once per AttentionMetadata."""

    num_tokens: int
    write_slots: Tensor  # [num_written] int64
    write_idx: Tensor | None  # rows of the input whose slot is not -1; None = all rows
    decode_rows: list[int]  # request indices with query_len == 1
    prefills: list[_Prefill]
    has_bidirectional_spans: bool
    # Built on first use, for whichever decode path the layers take.
    decode_groups: list[_DecodeGroup] | None = None
    decode_kernel_rows: _DecodeRows | None = None
    prefill_kernel_rows: _PrefillRows | None = None

    @property
    def num_decodes(self) -> int:
        return len(self.decode_rows)


# A decode row joins the current group while it needs more than this share of the group's
# padded length (or the group is still small): bounds the padding each row's gather carries.
# Groups of at most _MAX_GROUP rows keep the gathered K/V of one group near L2-sized.
_MIN_FILL = 0.5
_MIN_GROUP = 8
_MAX_GROUP = 16


def _group_decodes(md: AttentionMetadata, rows: list[int]) -> list[_DecodeGroup]:
    """Bucket decode rows by length so short contexts are not padded to the longest."""
    seq_lens, block_size = md.seq_lens_cpu, md.block_size
    buckets: list[list[int]] = []
    for i in sorted(rows, key=lambda r: -seq_lens[r]):
        if buckets and len(buckets[-1]) < _MAX_GROUP and (
                len(buckets[-1]) < _MIN_GROUP
                or seq_lens[i] > _MIN_FILL * seq_lens[buckets[-1][0]]):
            buckets[-1].append(i)
        else:
            buckets.append([i])
    if len(buckets) == 1:
        buckets = [rows]  # keep batch order: a pure decode step then needs no index shuffles
    device = md.block_table.device
    groups = []
    for bucket in buckets:
        lens = [seq_lens[i] for i in bucket]
        token_rows = [md.query_start_loc_cpu[i] for i in bucket]
        in_order = token_rows == list(range(len(bucket)))
        num_blocks = -(-max(lens) // block_size)
        seq_lens_t = torch.tensor(lens, dtype=torch.long, device=device)[:, None]
        rows_t = torch.tensor(bucket, dtype=torch.long, device=device)
        block_ids = md.block_table.index_select(0, rows_t)[:, :num_blocks].long()
        # Entries past a row's own blocks may be stale or -1: point them at block 0 (masked).
        in_use = torch.arange(num_blocks, device=device) * block_size < seq_lens_t
        groups.append(_DecodeGroup(
            None if in_order else torch.tensor(token_rows, dtype=torch.long, device=device),
            torch.where(in_use, block_ids, 0).reshape(-1), num_blocks, lens, seq_lens_t,
        ))
    return groups


def _build_plan(md: AttentionMetadata) -> _Plan:
    """Split the batch into decode groups and prefill chunks (pure bookkeeping, once a step)."""
    num_tokens = md.num_actual_tokens
    slots = md.slot_mapping[:num_tokens].long().contiguous()  # the C writer reads a plain int64 vector
    valid = slots >= 0
    write_idx = None
    if not bool(valid.all()):
        write_idx = valid.nonzero().squeeze(1)
        slots = slots[write_idx]

    qsl, seq_lens, block_size = md.query_start_loc_cpu, md.seq_lens_cpu, md.block_size
    decode_rows: list[int] = []
    prefills: list[_Prefill] = []
    for i in range(md.num_reqs):
        q_start, q_end = qsl[i], qsl[i + 1]
        query_len = q_end - q_start
        if query_len == 1:
            decode_rows.append(i)
        elif query_len > 1:
            num_context = seq_lens[i] - query_len
            block_ids = None
            if num_context > 0:
                num_blocks = -(-seq_lens[i] // block_size)
                block_ids = md.block_table[i, :num_blocks].long()
            spans = md.bidirectional_spans.get(i) if md.bidirectional_spans else None
            prefills.append(_Prefill(q_start, q_end, num_context, seq_lens[i], block_ids, i,
                                     spans=spans))
    # Chunks with image spans (Gemma3) need the masked SDPA path, not the C kernel.
    has_spans = any(p.spans for p in prefills)
    return _Plan(num_tokens, slots, write_idx, decode_rows, prefills, has_spans)


def _kernel_rows(md: AttentionMetadata, rows: list[int]) -> _DecodeRows:
    """The decode rows' token indices, block-table rows and lengths for the C kernel."""
    device = md.block_table.device
    token_rows = [md.query_start_loc_cpu[i] for i in rows]
    in_order = token_rows == list(range(len(rows)))
    if rows == list(range(len(rows))):
        block_table = md.block_table[: len(rows)]
    else:
        block_table = md.block_table.index_select(0, torch.tensor(rows, dtype=torch.long, device=device))
    return _DecodeRows(
        None if in_order else torch.tensor(token_rows, dtype=torch.long, device=device),
        block_table.to(torch.int32).contiguous(),
        torch.tensor([md.seq_lens_cpu[i] for i in rows], dtype=torch.int32, device=device),
    )


def _prefill_rows(md: AttentionMetadata, prefills: list[_Prefill]) -> _PrefillRows:
    """The prefill chunks' block-table rows, starts and lengths for the C kernel."""
    device = md.block_table.device
    rows = torch.tensor([p.req_index for p in prefills], dtype=torch.long, device=device)

    def int32(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return _PrefillRows(
        md.block_table.index_select(0, rows).to(torch.int32).contiguous(),
        int32([p.q_start for p in prefills]),
        int32([p.q_end - p.q_start for p in prefills]),
        int32([p.seq_len for p in prefills]),
    )


def _decode_blocked(group: _DecodeGroup, window: int | None, block_size: int) -> Tensor | None:
    """[B, 1, 1, L] bool, True where a key is padding or outside the window; None = none."""
    if window not in group.blocked:
        padded_len = group.num_blocks * block_size
        outside = window is not None and max(group.seq_lens) > window
        if min(group.seq_lens) == padded_len and not outside:
            group.blocked[window] = None
        else:
            pos = torch.arange(padded_len, device=group.seq_lens_t.device)
            blocked = pos >= group.seq_lens_t  # [B, L]
            if window is not None:
                blocked |= pos <= group.seq_lens_t - 1 - window
            group.blocked[window] = blocked[:, None, None, :]
    return group.blocked[window]


def _bidirectional_allowed(num_context: int, seq_len: int, window: int | None,
                           spans: list[tuple[int, int]], device: torch.device) -> Tensor:
    """Like _causal_allowed, but the positions of each span also see each other's later ones.

    HF Gemma3's image mask: full layers OR(causal, same span); sliding layers
    AND(key > query - window, OR(causal, same span)).
    """
    allowed = _causal_allowed(num_context, seq_len, None, device)
    for start, end in spans:
        end = min(end, seq_len)
        if end > max(start, num_context):
            allowed[max(start, num_context) - num_context : end - num_context, start:end] = True
    if window is not None:
        q_pos = torch.arange(num_context, seq_len, device=device)[:, None]
        allowed &= torch.arange(seq_len, device=device)[None, :] > q_pos - window
    return allowed


def _prefill_allowed(p: _Prefill, window: int | None, device: torch.device) -> Tensor | None:
    """The chunk's mask for `window`, cached on the chunk; None = plain causal (is_causal)."""
    if window not in p.masks:
        if p.spans:
            p.masks[window] = _bidirectional_allowed(p.num_context, p.seq_len, window, p.spans, device)
        elif p.num_context == 0 and (window is None or p.seq_len <= window):
            p.masks[window] = None
        else:
            p.masks[window] = _causal_allowed(p.num_context, p.seq_len, window, device)
    return p.masks[window]


def _attend_decodes(q: Tensor, kv_cache: Tensor, group: _DecodeGroup, num_kv_heads: int,
                    scale: float, window: int | None, soft_cap: float | None) -> Tensor:
    """q [B, H*D] of one decode group -> [B, H*D], over the group's gathered paged K/V.

    K/V are gathered head-major ([2, Hkv, B, L, D]) so both products are plain batched matmuls
    over Hkv*B contiguous matrices, with each KV head's G query heads as the query rows.
    """
    num_decodes = q.shape[0]
    block_size, head_dim = kv_cache.shape[2], cpu_attention.cache_head_dim(kv_cache)
    padded_len = group.num_blocks * block_size
    group_size = q.shape[1] // (num_kv_heads * head_dim)
    kv = kv_cache.permute(0, 3, 1, 2, 4).index_select(2, group.block_ids)  # [2, Hkv, B*n, bs, D]
    if kv.dtype == torch.int8:
        kv = int8_cache.dequantize(kv, q.dtype)
    kv = kv.view(2, num_kv_heads * num_decodes, padded_len, head_dim)
    qg = q.view(num_decodes, num_kv_heads, group_size, head_dim).transpose(0, 1)
    qg = qg.reshape(num_kv_heads * num_decodes, group_size, head_dim)  # [Hkv*B, G, D]
    scores = torch.bmm(qg, kv[0].transpose(1, 2)).mul_(scale)  # [Hkv*B, G, L]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    blocked = _decode_blocked(group, window, block_size)
    if blocked is not None:
        scores.view(num_kv_heads, num_decodes, group_size, padded_len).masked_fill_(
            blocked.view(1, num_decodes, 1, padded_len), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.bmm(probs, kv[1])  # [Hkv*B, G, D]
    return out.view(num_kv_heads, num_decodes, -1).transpose(0, 1).reshape(num_decodes, -1)


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    md: AttentionMetadata,
    num_kv_heads: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    cpu_kernels: bool = True,
) -> Tensor:
    """Write k/v into the paged cache, then attend q over each request's cached context.

    q: [num_tokens, H*D]; k, v: [num_tokens, Hkv*D]; kv_cache: [2, num_blocks, block_size,
    Hkv, D]. Returns [num_tokens, H*D]; padding rows past num_actual_tokens are zero.
    cpu_kernels: use the C kernels where they take the shapes (CpuAttentionBackend).
    """
    if isinstance(md, TorchAttentionMetadata):
        if md.plan is None:  # the first layer of the step splits the batch; the others reuse it
            md.plan = _build_plan(md)
        plan = md.plan
    else:
        plan = _build_plan(md)
    num_tokens, head_dim = plan.num_tokens, cpu_attention.cache_head_dim(kv_cache)
    num_heads = q.shape[1] // head_dim
    _write_cache(k[:num_tokens], v[:num_tokens], kv_cache, plan.write_slots, plan.write_idx)

    # The kernels read every token's K/V from the cache: all of them must have been written.
    use_kernels = cpu_kernels and plan.write_idx is None and cpu_attention.supports(q, kv_cache)
    kernel_prefills = use_kernels and not plan.has_bidirectional_spans
    pure_decode = plan.num_decodes == q.shape[0]
    # Every row gets written when the kernels cover all tokens (no padding rows to zero).
    out = (q.new_empty(q.shape) if kernel_prefills and num_tokens == q.shape[0]
           else q.new_zeros(q.shape))
    if use_kernels and plan.decode_rows:
        if plan.decode_kernel_rows is None:
            plan.decode_kernel_rows = _kernel_rows(md, plan.decode_rows)
        rows = plan.decode_kernel_rows
        cpu_attention.paged_decode_attention(
            q, out, kv_cache, rows.block_table, rows.seq_lens, rows.token_idx, num_kv_heads,
            scale, sliding_window, logits_soft_cap)
    elif plan.decode_rows:
        if plan.decode_groups is None:
            plan.decode_groups = _group_decodes(md, plan.decode_rows)
        groups = plan.decode_groups
        if len(groups) == 1 and groups[0].token_idx is None and pure_decode:
            # Pure decode step, tokens in request order: the group's output is the output.
            return _attend_decodes(q, kv_cache, groups[0], num_kv_heads, scale, sliding_window,
                                   logits_soft_cap)
        for group in groups:
            num_rows = len(group.seq_lens)
            if group.token_idx is None:
                out[:num_rows] = _attend_decodes(q[:num_rows], kv_cache, group, num_kv_heads,
                                                 scale, sliding_window, logits_soft_cap)
            else:
                o = _attend_decodes(q.index_select(0, group.token_idx), kv_cache, group,
                                    num_kv_heads, scale, sliding_window, logits_soft_cap)
                out.index_copy_(0, group.token_idx, o)
    if kernel_prefills:
        if plan.prefills:
            if plan.prefill_kernel_rows is None:
                plan.prefill_kernel_rows = _prefill_rows(md, plan.prefills)
            chunks = plan.prefill_kernel_rows
            cpu_attention.paged_prefill_attention(
                q, out, kv_cache, chunks.block_table, chunks.q_starts, chunks.q_lens,
                chunks.seq_lens, num_kv_heads, scale, sliding_window, logits_soft_cap)
        return out

    flat = kv_cache.view(2, kv_cache.shape[1], -1)
    int8 = kv_cache.dtype == torch.int8
    for p in plan.prefills:
        query_len = p.q_end - p.q_start
        qp = q[p.q_start : p.q_end].view(query_len, num_heads, head_dim).transpose(0, 1)
        if p.block_ids is None:  # no cached context: this chunk's K/V are the whole sequence
            kc, vc = k[p.q_start : p.q_end], v[p.q_start : p.q_end]
            if int8:
                kc, vc = int8_cache.round_trip(kc, num_kv_heads), int8_cache.round_trip(vc, num_kv_heads)
            kp = kc.reshape(query_len, num_kv_heads, head_dim).transpose(0, 1)
            vp = vc.reshape(query_len, num_kv_heads, head_dim).transpose(0, 1)
        else:
            kv = flat.index_select(1, p.block_ids)  # [2, blocks, block_size*Hkv*D]
            kv = kv.view(2, -1, num_kv_heads, kv_cache.shape[-1])[:, : p.seq_len]
            if int8:
                kv = int8_cache.dequantize(kv, q.dtype)
            kv = kv.transpose(1, 2)
            kp, vp = kv[0], kv[1]  # [Hkv, seq_len, D]
        allowed = _prefill_allowed(p, sliding_window, q.device)
        o = _sdpa(qp, kp, vp, allowed, scale, logits_soft_cap)  # [H, query_len, D]
        out[p.q_start : p.q_end] = o.transpose(0, 1).reshape(query_len, -1)
    return out


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The torch and CPU backends' metadata: the common fields, and the step's batch split,
    built by the first layer that attends and reused by the others."""

    plan: _Plan | None = field(default=None, repr=False, compare=False)


class TorchAttentionBackend(AttentionBackend):
    """Plain torch: the reference paths (gathered decodes, SDPA prefills), any device."""

    name: ClassVar[str] = "torch"
    metadata_cls: ClassVar[type[AttentionMetadata]] = TorchAttentionMetadata
    supports_bidirectional_spans: ClassVar[bool] = True
    supports_int8_cache: ClassVar[bool] = True
    cpu_kernels: ClassVar[bool] = False

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, md: AttentionMetadata,
                num_kv_heads: int, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> Tensor:
        return paged_attention(q, k, v, kv_cache, md, num_kv_heads, scale, sliding_window, logits_soft_cap,
                               cpu_kernels=self.cpu_kernels)


class CpuAttentionBackend(TorchAttentionBackend):
    """The C kernels for every decode and prefill whose shapes they take (dtype, head_dim,
    heads per kv head, the ISA; see cpu_attention.supports), the torch paths for the rest."""

    name: ClassVar[str] = "cpu"
    cpu_kernels: ClassVar[bool] = True
