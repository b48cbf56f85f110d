"""Gemma3 text decoder (gemma-3-1b style Gemma3ForCausalLM; the language model of Gemma3 VLMs).

What sets it apart from Llama (transformers' modeling_gemma3 is the reference):
- layers alternate local sliding-window attention and global attention (config.layer_types,
  5 local : 1 global), each with its own RoPE base (rope_parameters per layer type);
- Gemma RMSNorm scales by (1 + weight), computed in float32 before the cast back;
- q and k are RMS-normalised per head before RoPE, and scores are scaled by
  query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- four norms per layer (input, post-attention, pre- and post-feedforward);
- the embedding is multiplied by sqrt(hidden_size) (rounded to the model dtype, as HF does);
- GELU (tanh approximation) gated MLP; tied embeddings; optional final logit soft-capping.
transformers' Gemma3 ignores config.attn_logit_softcapping (Gemma3 replaced Gemma2's attention
soft-capping with the q/k norms; released configs set it to null), and so do we: outputs must
equal the reference's on any config.

The sliding-window layers give the engine a hybrid KV cache (lm_console/engine/core/kv_cache): their
blocks behind the window are freed while the request runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lm_console.engine.attention.layer import Attention
from lm_console.engine.models.layers import LogitsProjection, RopeAngles, RotaryEmbedding, rope_parameters
from lm_console.engine.models.llama import LlamaForCausalLM
from lm_console.engine.models.parallel_layers import (
    ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding,
)

SLIDING = "sliding_attention"
FULL = "full_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back to x's dtype at the end (HF Gemma3)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def norm_heads_(self, x: Tensor, num_heads: int) -> None:
        """Normalise each of the first num_heads heads of the rows x [T, >= H * D] in place."""
        heads = x[:, : num_heads * self.weight.shape[0]].view(x.shape[0], num_heads, -1)
        heads.copy_(self(heads))


def layer_types(config: Any) -> list[str]:
    """Each layer's attention type; configs without layer_types use the 5:1 pattern."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = int(getattr(config, "sliding_window_pattern", 6) or 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


def gemma3_rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """RoPE settings of one layer type.

    transformers 5 keeps {layer_type: {rope_type, rope_theta, ...}} in config.rope_parameters;
    older configs have rope_theta (+ rope_scaling) for global layers and rope_local_base_freq
    for local ones.
    """
    per_type = getattr(config, "rope_parameters", None) or {}
    if layer_type in per_type:
        params = dict(per_type[layer_type])
        params.setdefault("rope_type", params.pop("type", "default"))
        return params
    if layer_type == FULL:
        params = rope_parameters(config)
        params["rope_theta"] = getattr(config, "rope_theta", None) or 1_000_000.0
        return params
    return {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", None) or 10_000.0}


class Gemma3Attention(nn.Module):
    """Fused qkv, per-head q/k Gemma norms, RoPE of the layer's type, paged attention, o_proj."""

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.head_dim = config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        # Tensor parallelism splits the heads (see LlamaAttention): the counts are this rank's.
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias, dtype)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias, dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.is_sliding = layer_types(config)[layer_idx] == SLIDING
        sliding_window = int(config.sliding_window) if self.is_sliding else None
        self.attn = Attention(self.num_heads, self.head_dim, float(config.query_pre_attn_scalar) ** -0.5,
                              self.num_kv_heads, sliding_window=sliding_window)

    def forward(self, hidden: Tensor, rope: RopeAngles) -> Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (H + 2*Hkv) * D]
        self.q_norm.norm_heads_(qkv[:, : self.q_size], self.num_heads)  # in place, inside qkv
        self.k_norm.norm_heads_(qkv[:, self.q_size : self.q_size + self.kv_size], self.num_kv_heads)
        q, k = rope.rotate(qkv, self.num_heads, self.num_kv_heads)  # [T, H * D], [T, Hkv * D]
        v = qkv[:, self.q_size + self.kv_size :]  # [T, Hkv * D]
        return self.o_proj(self.attn(q, k, v))


class Gemma3MLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * inter, False, dtype, [inter, inter],
                                                 "intermediate_size")
        self.intermediate_size = self.gate_up_proj.local_sizes[0]  # this rank's
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, dtype, "intermediate_size")

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = Gemma3Attention(config, layer_idx, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, dtype)
        self.mlp = Gemma3MLP(config, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps, dtype)

    def forward(self, hidden: Tensor, rope: RopeAngles) -> Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), rope))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3TextModel(nn.Module):
    """Scaled embedding, decoder layers, final norm; names follow HF's `model.*` checkpoint keys."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        # HF rounds sqrt(hidden_size) to the model dtype before multiplying (55.4256 -> 55.5 in bf16).
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5, dtype=dtype), persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        max_position = config.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_position, gemma3_rope_parameters(config, FULL), dtype)
        self.rotary_emb_local = RotaryEmbedding(config.head_dim, max_position,
                                                gemma3_rope_parameters(config, SLIDING), dtype)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        """Token ids [T] -> scaled embeddings [T, hidden] (the VLM merges image features into these)."""
        return self.embed_tokens(input_ids) * self.normalizer

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None) -> Tensor:
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        rope = self.rotary_emb(positions)  # global layers
        rope_local = self.rotary_emb_local(positions)  # sliding layers
        for layer in self.layers:
            hidden = layer(hidden, rope_local if layer.self_attn.is_sliding else rope)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma3 causal LM over a flat token batch (HF checkpoint layout of Gemma3ForCausalLM)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.config = hf_config
        self.dtype = dtype
        self.model = Gemma3TextModel(hf_config, dtype)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(hf_config.hidden_size, hf_config.vocab_size, dtype)
        self.logits_projection = LogitsProjection()
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size], soft-capped if configured."""
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


# Checkpoint prefixes of the language model inside a Gemma3 VLM: transformers 5 saves
# `model.language_model.*`, the released checkpoints have `language_model.model.*`.
_VLM_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VLM_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                        "multi_modal_projector.")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma3 VLM (config.text_config), serving text-only prompts.

    The SigLIP tower and projector weights are skipped here; the registry serves Gemma3 VLM
    checkpoints with the subclass that adds the vision path (lm_console/engine/models/gemma3_mm.py).
    """

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        text_config = hf_config.get_text_config()
        super().__init__(text_config, dtype)
        self.vlm_config = hf_config

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Rename the language model's tensors to Gemma3ForCausalLM's, skip the vision ones."""

        def text_weights() -> Iterable[tuple[str, Tensor]]:
            for name, tensor in weights:
                if name.startswith(_VLM_VISION_PREFIXES):
                    continue
                for old, new in _VLM_TEXT_PREFIXES:
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                yield name, tensor

        super().load_weights(text_weights())
