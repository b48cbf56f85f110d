"""oneDNN weight prepacking for the CPU bf16 linear layers.

F.linear in bf16 on the CPU calls oneDNN, which reorders W into its blocked layout on every
call; for the small row counts of decode steps that reorder is a large share of the matmul.
Packing each weight once at load (the op PyTorch's own CPU compiler uses when it freezes a
model) measured 1.1-1.4x on the embedded model's decode shapes (M = 32-64) and up to 2-5x for a
single row, with bit-identical results. float32 keeps plain F.linear: the greedy-vs-HF tests
compare it op for op. LMC_ONEDNN_PREPACK=0 turns packing off.

The packed copy lives beside the original weight (tied embeddings and introspection still read
W), so the linear weights take twice their size in host memory.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from lm_console.engine import envs
from lm_console.engine.models.layers import Linear

logger = logging.getLogger(__name__)

# The batch-size hint oneDNN packs for; measured as good as the per-shape hints across 1-2048 rows.
_PACK_FOR_ROWS = 2048


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether this torch's oneDNN packs bf16 linear weights on this CPU (asked once, on a small
    weight): its bf16 reorder needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT, so an AVX2-only CPU
    keeps F.linear."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), _PACK_FOR_ROWS)
    except RuntimeError as exc:
        logger.info("oneDNN bf16 weight prepacking is unavailable on this CPU (%s): bf16 linears use F.linear",
                    str(exc).splitlines()[0])
        return False
    return True


def prepack_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linears of this dtype on this device get packed weights."""
    if envs.LMC_ONEDNN_PREPACK.is_off():
        return False
    return device.type == "cpu" and dtype == torch.bfloat16 and onednn_packs_bf16()


def prepack_linears(model: nn.Module) -> int:
    """Pack every bf16 CPU Linear's weight for oneDNN; returns how many were packed.

    The first packed layer is checked against F.linear on a random input; any difference (a
    oneDNN build that packs differently) leaves the whole model on F.linear.
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)
               and prepack_available(m.weight.dtype, m.weight.device)]
    checked = False
    for linear in linears:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _PACK_FOR_ROWS)
        except RuntimeError as exc:
            logger.warning("oneDNN weight prepacking unavailable, using F.linear: %s", exc)
            return 0
        linear.packed_weight = packed
        if not checked:
            x = torch.randn(5, linear.weight.shape[1], dtype=linear.weight.dtype)
            if not torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias)):
                logger.warning("oneDNN packed linear differs from F.linear: prepacking off")
                linear.packed_weight = None
                return 0
            checked = True
    return len(linears)
