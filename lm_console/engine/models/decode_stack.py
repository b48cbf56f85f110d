"""A pure-decode step of a Llama-family model in one C call (lm_console/kernels/cpu_decode.py).

At one row a decode step's kernels are short (the embedded model's 30 layers: ~15 kernels each,
most of them a few microseconds), and calling them one at a time from Python cost about as much
again: module calls, torch dispatches, argument checks, ctypes conversions and a fresh output
tensor per op. `DecodeStack` hands the whole decoder stack to a C driver that calls the same
kernels in the same order over persistent buffers.

It serves a step only when everything it does is what the layer-by-layer forward would do:
- the model: LlamaModel's layers (Llama, Mistral, Qwen2, Qwen3), bf16 on the CPU, one
  tensor-parallel rank, every linear quantized (quantization="gguf" / "int8": the same
  quant_gemm calls, bit-identical hidden states) or dense bf16 (the driver's own GEMV: oneDNN
  accumulates in another order, so close to but not bit-equal with torch's; measured 15-25%
  less CPU time per batch-1 forward on the embedded model);
- the step: decode rows only (query_len 1 each, rows in request order, no padding), at most
  `max_rows` of them, every K/V slot valid, no KV connector, no per-group metadata, no image
  spans, no inputs_embeds, and the C attention kernel serving the cache (bf16, or int8 with
  the int8 cache's kernels in the table);
- LoRA: a step whose tokens use adapters (lora.py's step mapping) when the layer path would add
  their deltas with the C LoRA kernel (LMC_LORA_KERNEL auto or cpu): the driver calls that
  kernel after each linear with adapter slots, on the same inputs, so those steps stay
  bit-identical too.
Any other step returns None and the caller runs the usual forward. LMC_DECODE_STACK=0 turns it
off, =quant keeps it to quantized models. float32 models never use it (the HF-exactness tests
compare their torch path op for op).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from lm_console.engine import envs
from lm_console.engine.attention.torch_backend import CpuAttentionBackend
from lm_console.engine.forward_context import get_forward_context
from lm_console.engine.models import lora
from lm_console.kernels import cpu_attention, cpu_decode, cpu_quant

# Rows above which a step takes the usual forward. Quantized: every decode batch up to MAX_ROWS
# (the driver's scratch is sized for it, about 6 MB for the embedded model), or fewer where
# LMC_QUANT_DENSE_ROWS makes the layer path's linears switch to dequantize + oneDNN from that
# many rows (the driver would not; by default they never switch). Dense: the driver's GEMV re-reads each weight tile per row from
# L1; oneDNN's blocked GEMM overtakes it as rows grow, so a smaller bound.
MAX_ROWS = 256
DENSE_MAX_ROWS = 8


def _mode() -> str:
    """LMC_DECODE_STACK: "0"/"off" (never), "quant" (quantized models only), "1" (default: also
    dense bf16 models)."""
    return envs.LMC_DECODE_STACK.get().lower()


def _is_llama_forward(forward: Any, owner: str) -> bool:
    """Whether `forward` is engine.models.llama's `owner.forward` itself (a subclass that overrides
    it computes something else). By name: llama.py imports this module, not the other way."""
    return (getattr(forward, "__module__", None) == "lm_console.engine.models.llama"
            and getattr(forward, "__qualname__", None) == f"{owner}.forward")


def unsupported_reason(model: Any) -> str | None:
    """Why `model` (a LlamaModel) cannot use the driver, or None when it can."""
    mode = _mode()
    if mode in ("0", "off", "false"):
        return "LMC_DECODE_STACK is off"
    if not model.layers or not all(_is_llama_forward(type(layer).forward, "LlamaDecoderLayer")
                                   and _is_llama_forward(type(layer.self_attn).forward, "LlamaAttention")
                                   for layer in model.layers):
        return "not a Llama-family decoder stack"
    if model.embed_tokens.weight.dtype != torch.bfloat16 and model.embed_tokens.quant is None:
        return "the model is not bf16"
    if not model.norm.use_cpu_kernels or not model.rotary_emb.use_cpu_kernels:
        return "the fused bf16 CPU kernels do not serve this model"
    if getattr(model.embed_tokens, "tp_size", 1) != 1:
        return "tensor parallel"
    quantized = dense = 0
    for layer in model.layers:
        for linear in _linears(layer):
            if getattr(linear, "tp_size", 1) != 1:
                return "tensor parallel"
            if linear.quant is not None:
                quantized += 1
            elif linear.weight.dtype == torch.bfloat16 and linear.weight.device.type == "cpu":
                dense += 1
            else:
                return "a linear is neither quantized nor bf16 on the CPU"
    if dense and mode == "quant":
        return "dense bf16 linears (LMC_DECODE_STACK=quant keeps the driver to quantized models)"
    library = cpu_decode.load()
    if library is None or cpu_decode.kernel_table() is None:
        return "the C kernels are not available"
    if dense and not library.decode_stack_has_bf16():
        return "no AVX512-BF16: the driver's portable dense GEMV would be slower than oneDNN"
    return None


def _linears(layer: Any) -> tuple[Any, Any, Any, Any]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _lora_fields(linear: Any) -> list[int]:
    """A linear's adapter slots as the driver reads them (a, b, rank), zeros without slots."""
    slots = linear.lora
    if slots is None:
        return [0, 0, 0]
    return [slots.a.data_ptr(), slots.b_t.data_ptr(), slots.a.shape[1]]


def _lora_slots_suit(linear: Any) -> bool:
    """Whether the C LoRA kernel takes this linear's slots as the layer path hands them to it."""
    slots = linear.lora
    return slots is not None and slots.b_t is not None and all(
        t.dtype == torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu" for t in (slots.a, slots.b_t))


def _linear_fields(linear: Any, keep: list[Tensor]) -> list[int]:
    """One linear's row of the driver's layer array (cpu_decode.LINEAR order)."""
    q = linear.quant
    if q is None:
        w = linear.weight.detach()
        if not w.is_contiguous():
            raise ValueError("dense weight must be contiguous")
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        keep.extend(t for t in (w, bias) if t is not None)
        return [cpu_decode.FMT_DENSE_BF16, w.shape[0], w.shape[1], w.shape[1], w.data_ptr(), 0, 0,
                bias.data_ptr() if bias is not None else 0] + _lora_fields(linear)
    bias = linear.quant_bias
    keep.extend(t for t in (q.qweight, q.scales, q.offsets, bias) if t is not None)
    return [cpu_quant.FORMATS[q.fmt], q.out_features, q.in_features, q.padded_in, q.qweight.data_ptr(),
            q.scales.data_ptr(), q.offsets.data_ptr() if q.offsets is not None else 0,
            bias.data_ptr() if bias is not None else 0] + _lora_fields(linear)


class DecodeStack:
    """The C driver's view of one LlamaModel: its plan (pointers into the model's weights and
    KV caches, rebuilt when the caches are re-bound or a dense weight is replaced; the model
    makes a new DecodeStack when its weights are swapped, weights_version()) and persistent
    scratch buffers."""

    def __init__(self, model: Any) -> None:
        self.model = model
        dense = any(linear.quant is None for layer in model.layers for linear in _linears(layer))
        self.max_rows = DENSE_MAX_ROWS if dense else min(MAX_ROWS, cpu_quant.dense_rows())
        self.library = cpu_decode.load()
        self.kernels = cpu_decode.kernel_table()
        # The attention layers, looked up once: nn.Module attribute access is slow, and the
        # staleness check runs every step.
        self._attns = [layer.self_attn.attn for layer in model.layers]
        self._caches: list[Tensor | None] = []
        self._step = (ctypes.c_int64 * len(cpu_decode.STEP))()
        self._keep: list[Tensor] = []
        self._layers: Tensor | None = None
        self._dense: list[tuple[Any, Tensor]] = []  # (linear, the weight Parameter the plan reads)
        self._usable = False  # whether the last _build made a plan (else the caches do not suit)
        self._max_loras = 0
        self._serves_lora = False  # whether the plan adds the adapters' deltas (every linear has slots)

    # -- plan ---------------------------------------------------------------------------------
    def _stale(self) -> bool:
        if not self._caches:
            return True
        for attn, cache in zip(self._attns, self._caches):
            if attn.kv_cache is not cache:
                return True
        # Dense weights are read in place: a Parameter swapped for another would leave the plan
        # pointing at freed memory (an in-place copy, as load_weights does, is fine).
        return any(linear.weight is not weight for linear, weight in self._dense)

    def _build(self) -> bool:
        """(Re)build the plan; False if the KV caches do not suit the driver (remembered until
        the caches or the weights change, so an unsuitable model pays one check per step)."""
        self._caches = [attn.kv_cache for attn in self._attns]
        self._dense = []
        self._usable = self._make_plan()
        return self._usable

    def _make_plan(self) -> bool:
        model = self.model
        keep: list[Tensor] = []
        first = model.layers[0].self_attn
        attn0 = first.attn
        caches = self._caches
        if any(c is None or c.dtype not in (torch.bfloat16, torch.int8) or not c.is_contiguous()
               or c.dtype != caches[0].dtype for c in caches):
            return False
        # one scale and soft-cap for every layer: the driver takes them once
        if any(attn.kv_cache_group_id or not isinstance(attn.backend, CpuAttentionBackend) or attn.scale != attn0.scale
               or attn.logits_soft_cap != attn0.logits_soft_cap for attn in self._attns):
            return False
        block_size = caches[0].shape[2]
        if any(c.shape[2] != block_size for c in caches):
            return False
        # the attention kernel must take the cache's shape (else the layer path's torch fallback)
        q_like = torch.empty(1, first.num_heads * first.head_dim, dtype=torch.bfloat16)
        if not cpu_attention.supports(q_like, caches[0]):
            return False
        linears = [linear for layer in model.layers for linear in _linears(layer)]
        # Adapter steps only where the layer path would add the deltas with the C kernel too.
        want_lora = (envs.LMC_LORA_KERNEL.get().lower() in ("auto", "cpu")
                     and all(_lora_slots_suit(linear) for linear in linears))
        kernels = cpu_decode.kernel_table(int8_cache=caches[0].dtype == torch.int8, lora=want_lora)
        if kernels is None:
            return False
        self.kernels = kernels
        self._serves_lora = want_lora and kernels[cpu_decode.KERNELS.index("lora_add_bf16")] is not None
        max_loras = self._max_loras = linears[0].lora.a.shape[0] if self._serves_lora else 0
        if self._serves_lora:
            keep += [t for linear in linears for t in (linear.lora.a, linear.lora.b_t)]
        self._dense = [(linear, linear.weight) for layer in model.layers for linear in _linears(layer)
                       if linear.quant is None]
        rows = []
        for layer, cache in zip(model.layers, caches):
            attn = layer.self_attn
            fields: list[int] = []
            for linear in _linears(layer):
                fields += _linear_fields(linear, keep)
            q_norm = attn.q_norm.weight.data_ptr() if attn.use_qk_norm else 0
            k_norm = attn.k_norm.weight.data_ptr() if attn.use_qk_norm else 0
            fields += [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                       q_norm, k_norm, cache[0].data_ptr(), cache[1].data_ptr(), cache.stride(1),
                       attn.attn.sliding_window or 0]
            rows.append(fields)
        self._layers = torch.tensor(rows, dtype=torch.int64)
        hidden = model.norm.weight.shape[0]
        inter = model.layers[0].mlp.down_proj.weight.shape[1]  # a meta tensor of the shape if quantized
        heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        cos = model.rotary_emb.cos
        g = {"layers": len(model.layers), "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
             "head_dim": head_dim, "inter": inter, "block_size": block_size, "qk_norm": int(first.use_qk_norm),
             "max_rows": self.max_rows, "max_position": cos.shape[0],
             "num_slots": min(c.shape[1] for c in caches) * block_size,  # the K/V writes' bound
             "kv_int8": int(caches[0].dtype == torch.int8), "max_loras": max_loras}
        self._globals = torch.tensor([g[name] for name in cpu_decode.GLOBALS], dtype=torch.int64)
        m = self.max_rows
        kp = max(cpu_quant.padded(hidden), cpu_quant.padded(inter))
        bf16 = torch.bfloat16
        sizes = {"res_a": (m * hidden, bf16), "res_b": (m * hidden, bf16), "normed": (m * hidden, bf16),
                 "qkv": (m * (heads + 2 * kv_heads) * head_dim, bf16), "attn": (m * heads * head_dim, bf16),
                 "gate_up": (m * 2 * inter, bf16), "act": (m * inter, bf16), "xq": (m * kp, torch.int8),
                 "xd": (m * kp // cpu_quant.BLOCK, torch.float32), "xs": (m * kp // cpu_quant.BLOCK, torch.float32),
                 "cos": (m * head_dim // 2, torch.float32), "sin": (m * head_dim // 2, torch.float32)}
        self._buffers = [torch.empty(numel, dtype=dtype) for numel, dtype in (sizes[name] for name in cpu_decode.BUFFERS)]
        self._buffer_ptrs = (ctypes.c_void_p * len(self._buffers))(*(b.data_ptr() for b in self._buffers))
        self._keep = keep + [model.norm.weight, cos, model.rotary_emb.sin]
        self._args = (ctypes.c_void_p(self._globals.data_ptr()), ctypes.c_void_p(self._layers.data_ptr()),
                      ctypes.c_void_p(model.norm.weight.data_ptr()), float(model.norm.eps), float(attn0.scale),
                      float(attn0.logits_soft_cap or 0.0),
                      ctypes.c_void_p(cos.data_ptr()), ctypes.c_void_p(model.rotary_emb.sin.data_ptr()))
        return True

    # -- step ---------------------------------------------------------------------------------
    def run(self, input_ids: Tensor, positions: Tensor) -> Tensor | None:
        """The final-norm hidden states [rows, hidden] of a pure-decode step, or None when this
        step is not one the driver serves (nothing was computed or written then)."""
        context = get_forward_context()
        md = context.attn_metadata
        rows = input_ids.shape[0]
        if (md is None or context.group_attn_metadata is not None or context.kv_connector is not None
                or md.bidirectional_spans or md.max_query_len != 1 or rows > self.max_rows
                or md.num_reqs != rows or md.num_actual_tokens != rows or positions.shape[0] != rows):
            return None
        if not (self._build() if self._stale() else self._usable):
            return None
        mapping = lora.active_mapping()
        token_slots = scalings = None
        if mapping is not None and mapping.has_adapters:
            token_slots, scalings = mapping.token_slots, mapping.scalings
            if (not self._serves_lora or token_slots.shape != (rows,) or token_slots.dtype != torch.int64
                    or not token_slots.is_contiguous() or scalings.dtype != torch.float32
                    or not scalings.is_contiguous() or scalings.shape[0] != self._max_loras):
                return None
        slots, block_table, seq_lens = md.slot_mapping, md.block_table, md.seq_lens
        if (slots.dtype != torch.int64 or block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32
                or positions.dtype != torch.int64 or block_table.stride(1) != 1 or not slots.is_contiguous()
                or not seq_lens.is_contiguous() or not positions.is_contiguous() or slots.device.type != "cpu"):
            return None
        embeds = self.model.embed_tokens(input_ids)
        if embeds.dtype != torch.bfloat16 or not embeds.is_contiguous():
            return None
        out = torch.empty_like(embeds)
        step = self._step
        step[0], step[1], step[2], step[3] = rows, embeds.data_ptr(), out.data_ptr(), positions.data_ptr()
        step[4], step[5], step[6], step[7] = (slots.data_ptr(), block_table.data_ptr(), block_table.stride(0),
                                              seq_lens.data_ptr())
        step[8] = block_table.shape[1]
        step[9] = token_slots.data_ptr() if token_slots is not None else 0
        step[10] = scalings.data_ptr() if scalings is not None else 0
        status = self.library.decode_stack_run(self.kernels, *self._args, self._buffer_ptrs, step)
        if status == -1:
            return None
        if status >= 100:
            raise ValueError(f"the CPU LoRA kernel refused this step's adapters (status {status - 100}: "
                             "1 a slot out of range, 2 a rank outside [1, 4096], 3 out of memory, 4 a strided buffer)")
        if status != 0:
            raise ValueError(f"the CPU decode kernel refused this model's attention shape (status {status})")
        return out


def attach(model: Any) -> DecodeStack | None:
    """A DecodeStack for `model` (a LlamaModel), or None when it cannot use one."""
    if unsupported_reason(model) is not None:
        return None
    return DecodeStack(model)


