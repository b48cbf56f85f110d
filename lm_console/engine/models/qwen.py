"""Qwen2 and Qwen3: the Llama decoder with q/k/v bias (Qwen2) or per-head q/k RMSNorm (Qwen3)."""

from __future__ import annotations

from lm_console.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    """q/k/v projections always carry a bias; o_proj never does."""

    qkv_bias_default = True


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM."""

    layer_cls = Qwen2DecoderLayer


class Qwen3Attention(LlamaAttention):
    """RMSNorm over each q and k head before rope; biases follow config.attention_bias."""

    use_qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense) causal LM."""

    layer_cls = Qwen3DecoderLayer
