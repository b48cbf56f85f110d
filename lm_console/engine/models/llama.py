"""Llama-family decoder (Llama, SmolLM2, Mistral; Qwen2/Qwen3 subclass it in qwen.py).

Our own forward over a flat batch of tokens: q/k/v come from one fused matmul, gate/up from
another (fused at load time from the HF checkpoint's separate projections), and attention reads
and writes the paged KV cache through `engine.attention.Attention`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lm_console.engine.attention.layer import Attention
from lm_console.engine.models import decode_stack, layers, lora
from lm_console.engine.models.layers import LogitsProjection, RMSNorm, RopeAngles, RotaryEmbedding, SiluAndMul, rope_parameters
from lm_console.engine.models.parallel_layers import (
    ColumnParallelLinear, LazyWeight, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
    VocabParallelEmbedding, as_tensor,
)
from lm_console.kernels import cpu_quant

# HF checkpoint projection -> (our fused parameter, shard index); see _fused_shards.
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _sliding_window(config: Any, layer_idx: int) -> int | None:
    """The layer's attention window, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types and layer_types[layer_idx] != "sliding_attention"):
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


class LlamaAttention(nn.Module):
    """Self-attention block: fused qkv projection, (optional per-head q/k norm), rope, o_proj.

    Under tensor parallelism the heads are split: num_heads / num_kv_heads are this rank's,
    its KV cache holds its KV heads only, and o_proj all-reduces the ranks' partial outputs.
    """

    qkv_bias_default = False  # Qwen2 forces bias on q/k/v whatever the config says
    o_bias_default = False
    use_qk_norm = False  # Qwen3: RMSNorm over each head of q and k before rope

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads,
                                          bias or self.qkv_bias_default, dtype)
        self.num_heads = self.qkv_proj.num_local_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                        bias or self.o_bias_default, dtype)
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5,
                              self.num_kv_heads, sliding_window=_sliding_window(config, layer_idx))

    def forward(self, hidden: Tensor, rope: RopeAngles) -> Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (H + 2*Hkv) * D]
        if self.use_qk_norm:  # in place, inside qkv
            self.q_norm.norm_heads_(qkv[:, : self.q_size], self.num_heads)
            self.k_norm.norm_heads_(qkv[:, self.q_size : self.q_size + self.kv_size], self.num_kv_heads)
        q, k = rope.rotate(qkv, self.num_heads, self.num_kv_heads)  # [T, H * D], [T, Hkv * D]
        v = qkv[:, self.q_size + self.kv_size :]  # [T, Hkv * D]
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * inter, bias, dtype, [inter, inter],
                                                 "intermediate_size")
        self.act_fn = SiluAndMul(dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, dtype, "intermediate_size")

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        down = self.down_proj
        if down.quant is not None:
            # The int8 kernel quantizes silu(gate) * up as it reads gate | up: no [T, I] pass.
            out = cpu_quant.quant_linear(gate_up, down.quant, down.quant_bias, swiglu=True)
            if down.lora is not None and lora.step_has_adapters():
                # The base keeps its fused kernel; the adapters' delta needs the activation itself.
                return lora.add_delta(down.lora, self.act_fn(gate_up), out)
            return out
        return down(self.act_fn(gate_up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream travels beside the sublayer outputs (as in vLLM): each layer adds the
    previous sublayer's output to it inside the next norm (`RMSNorm.add_and_norm`, one fused
    pass in bf16) and hands its MLP output on unadded. The float32 results are unchanged.
    """

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = self.attention_cls(config, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype)

    def forward(self, hidden: Tensor, residual: Tensor | None, rope: RopeAngles) -> tuple[Tensor, Tensor]:
        """(previous MLP output, residual stream before it; None for the first layer, whose
        `hidden` is the embeddings) -> (this layer's MLP output, the stream before it)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, rope)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm; names follow HF's `model.*` checkpoint keys."""

    def __init__(self, config: Any, dtype: torch.dtype, layer_cls: type[LlamaDecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            layer_cls(config, i, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(_head_dim(config), config.max_position_embeddings,
                                          rope_parameters(config), dtype)
        # The whole-stack C driver for pure-decode steps (decode_stack.py), decided on first
        # use and again whenever the weights are swapped (quantized after load).
        self._decode_stack: decode_stack.DecodeStack | None = None
        self._decode_stack_version = -1

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None) -> Tensor:
        # inputs_embeds: text + image embeddings already merged by a multimodal wrapper.
        if inputs_embeds is None and input_ids.shape[0] <= decode_stack.MAX_ROWS:
            if self._decode_stack_version != layers.weights_version():
                self._decode_stack = decode_stack.attach(self)
                self._decode_stack_version = layers.weights_version()
            if self._decode_stack is not None:
                hidden = self._decode_stack.run(input_ids, positions)
                if hidden is not None:
                    return hidden
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        rope = self.rotary_emb(positions)  # shared by the layers
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope)
        if residual is None:
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Causal LM over a flat token batch; attention state comes from the forward context."""

    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.model = LlamaModel(hf_config, dtype, self.layer_cls)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.hidden_size, hf_config.vocab_size, dtype)
        self.logits_projection = LogitsProjection()  # fp32 logits from the bf16 head
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None) -> Tensor:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        """Token embeddings [num_tokens, hidden_size] (multimodal wrappers merge into these)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size] (on every TP rank)."""
        return self.lm_head.gather(self.logits_projection(hidden_states, self.lm_head))

    def load_weights(self, weights: Iterable[tuple[str, Tensor | LazyWeight]]) -> None:
        """Copy HF-named checkpoint tensors in, fusing q/k/v and gate/up; every param must load.

        A parallel layer's parameter has a weight_loader that takes this rank's slice (of a
        LazyWeight: reading only that slice); the others are copied whole.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        saw_lm_head = False
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # old checkpoints store the rope buffer; ours is computed
            if name.startswith("lm_head."):
                saw_lm_head = True
                if self.tie_word_embeddings:
                    continue  # tied: the embedding is the head
            target, shard = name, None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            weight_loader = getattr(param, "weight_loader", None)
            if weight_loader is not None:
                weight_loader(param, tensor, shard)
            elif shard is None:
                _copy(param.data, as_tensor(tensor), name)
            else:
                start, size = self._fused_shards(target)[shard]
                _copy(param.data.narrow(0, start, size), as_tensor(tensor), name)
            loaded.add(target if shard is None else f"{target}#{shard}")
        if not saw_lm_head and not self.tie_word_embeddings:
            # A checkpoint without lm_head means the head is the (tied) embedding.
            self.lm_head.weight = self.model.embed_tokens.weight
            self.tie_word_embeddings = True
        self._check_all_loaded(params, loaded)

    def _fused_shards(self, fused_name: str) -> list[tuple[int, int]]:
        """(row offset, rows) of each original projection inside a fused parameter."""
        if ".qkv_proj." in fused_name:
            attn = self.model.layers[0].self_attn
            return [(0, attn.q_size), (attn.q_size, attn.kv_size),
                    (attn.q_size + attn.kv_size, attn.kv_size)]
        inter = self.config.intermediate_size
        return [(0, inter), (inter, inter)]

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if ".qkv_proj." in name or ".gate_up_proj." in name:
                num_shards = len(self._fused_shards(name))
                missing += [f"{name}#{i}" for i in range(num_shards) if f"{name}#{i}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


def _copy(dst: Tensor, src: Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama math; sliding_window (if any) is applied by the attention layers."""
