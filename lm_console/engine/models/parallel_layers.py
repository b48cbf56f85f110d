"""Tensor-parallel layers: each rank holds a slice of a weight and loads only that slice.

Megatron's split, as vLLM does it:
- ColumnParallelLinear: W's output rows split over the ranks (no communication); a fused
  weight (q|k|v, gate|up) splits each of its sub-matrices, so rank r holds q_r|k_r|v_r.
  QKVParallelLinear is the q/k/v case, split by heads.
- RowParallelLinear: W's input columns split; each rank's partial product is summed with one
  all-reduce (after o_proj and after down_proj), then the bias is added once.
- VocabParallelEmbedding: vocabulary rows split (padded to a multiple of the ranks); ids
  outside a rank's rows give zeros, and an all-reduce assembles the embeddings.
- ParallelLMHead: the vocabulary rows of the head split alike; the logits are all-gathered,
  so every rank samples from the same full logits (see ModelRunner.sample_tokens).
With one rank every layer computes exactly what its plain counterpart in layers.py computes.

Weights reach a layer through its parameters' `weight_loader(param, weight, shard_id)`;
`weight` is a tensor or a LazyWeight (a safetensors slice) of which only the rank's rows or
columns are read from disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lm_console.engine.distributed.parallel_state import get_tp_group
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.models.layers import Embedding, Linear


class LazyWeight:
    """A checkpoint tensor not read yet (a safetensors slice): narrow() reads only its part."""

    def __init__(self, tensor_slice: Any) -> None:
        self._slice = tensor_slice

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> Tensor:
        index: tuple[slice, ...] = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def materialize(self) -> Tensor:
        return self._slice[:]


def as_tensor(weight: Tensor | LazyWeight) -> Tensor:
    """The whole tensor (read now if lazy)."""
    return weight.materialize() if isinstance(weight, LazyWeight) else weight


def divide(numerator: int, world_size: int, what: str) -> int:
    """numerator / world_size, refusing a remainder with a message naming `what`."""
    if numerator % world_size:
        raise InvalidEngineArgsError(
            f"tensor_parallel_size={world_size} does not divide {what}={numerator}; "
            f"choose a tensor_parallel_size that divides it.")
    return numerator // world_size


def _copy(dst: Tensor, src: Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint slice shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(Linear):
    """y_r = x W_r^T: this rank's share of each sub-matrix of W's output rows (shard_sizes)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 shard_sizes: Sequence[int] | None = None, what: str = "the output features") -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.shard_sizes = list(shard_sizes or [out_features])
        assert sum(self.shard_sizes) == out_features, (self.shard_sizes, out_features)
        self.local_sizes = [divide(size, self.tp_size, what) for size in self.shard_sizes]
        super().__init__(in_features, sum(self.local_sizes), bias, dtype)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, weight: Tensor | LazyWeight, shard_id: int | None = None) -> None:
        """Copy this rank's rows of sub-matrix shard_id (None: the whole, unfused W)."""
        shard = 0 if shard_id is None else shard_id
        offset, size = sum(self.local_sizes[:shard]), self.local_sizes[shard]
        src = weight.narrow(0, self.tp_rank * size, size)
        _copy(param.data.narrow(0, offset, size), src, f"shard {shard} rank {self.tp_rank}")


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q|k|v projection split by heads: rank r computes its heads' q, k and v."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype) -> None:
        tp_size = get_tp_group().world_size
        self.num_local_heads = divide(num_heads, tp_size, "num_attention_heads")
        self.num_local_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, q_size + 2 * kv_size, bias, dtype, [q_size, kv_size, kv_size])


class RowParallelLinear(Linear):
    """y = sum_r x_r W_r^T (+ b): W's input columns split, partial sums all-reduced, bias once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 what: str = "the input features") -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        super().__init__(divide(in_features, self.tp_size, what), out_features, bias, dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self.bias_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, weight: Tensor | LazyWeight, shard_id: int | None = None) -> None:
        size = param.shape[1]
        _copy(param.data, weight.narrow(1, self.tp_rank * size, size), f"rank {self.tp_rank}")

    def bias_loader(self, param: nn.Parameter, weight: Tensor | LazyWeight, shard_id: int | None = None) -> None:
        _copy(param.data, as_tensor(weight), "bias")

    def forward(self, x: Tensor) -> Tensor:
        """x [T, in / tp] -> [T, out], the same on every rank."""
        if self.tp_size == 1:
            return super().forward(x)
        if self.packed_weight is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")
        else:
            y = F.linear(x, self.weight)
        y = get_tp_group().all_reduce(y)
        return y if self.bias is None else y + self.bias


def _vocab_rows(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first row, rows per rank) of rank tp_rank's vocabulary slice (padded to tp_size)."""
    rows = -(-vocab_size // tp_size)
    return tp_rank * rows, rows


def _load_vocab_rows(param: nn.Parameter, weight: Tensor | LazyWeight, start: int, vocab_size: int) -> None:
    rows = param.shape[0]
    num_real = max(0, min(rows, vocab_size - start))
    if num_real:
        _copy(param.data[:num_real], weight.narrow(0, start, num_real), f"vocab rows from {start}")
    param.data[num_real:].zero_()  # padding rows: never looked up, logits cut off


class VocabParallelEmbedding(Embedding):
    """Token id -> embedding row, the vocabulary split over the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size, self.vocab_size = tp.rank, tp.world_size, vocab_size
        self.vocab_start, rows = _vocab_rows(vocab_size, self.tp_size, self.tp_rank)
        super().__init__(rows, hidden_size, dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, weight: Tensor | LazyWeight, shard_id: int | None = None) -> None:
        _load_vocab_rows(param, weight, self.vocab_start, self.vocab_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        embeddings = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        embeddings.masked_fill_(outside.unsqueeze(-1), 0)
        return get_tp_group().all_reduce(embeddings)


class ParallelLMHead(Linear):
    """Logits over the full vocabulary; each rank computes its vocabulary rows, then all-gather.

    Tied to a VocabParallelEmbedding by sharing its weight: both split the rows the same way.
    """

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype) -> None:
        tp = get_tp_group()
        self.tp_rank, self.tp_size, self.vocab_size = tp.rank, tp.world_size, vocab_size
        self.vocab_start, rows = _vocab_rows(vocab_size, self.tp_size, self.tp_rank)
        super().__init__(hidden_size, rows, False, dtype)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, weight: Tensor | LazyWeight, shard_id: int | None = None) -> None:
        _load_vocab_rows(param, weight, self.vocab_start, self.vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        """x [n, hidden] -> logits [n, vocab_size] on every rank."""
        return self.gather(super().forward(x))

    def gather(self, logits: Tensor) -> Tensor:
        """This rank's logits [n, rows] -> the whole vocabulary's [n, vocab_size] on every rank."""
        if self.tp_size == 1:
            return logits
        return get_tp_group().all_gather(logits, dim=-1)[:, :self.vocab_size]
