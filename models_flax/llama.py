"""Llama family (Llama, Mistral, Qwen2, Qwen3): qkv bias, qk-norm, sliding windows, tied embeddings.

Attribute names follow the canonical weight names of `model_loader/spec.py`
(`layers.{i}.self_attn.q_proj.weight` is `model.layers[i].self_attn.q_proj.weight`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from xlaserve.models_flax.attention import Attention, AttentionMetadata, KVCache
from xlaserve.models_flax.layers import Embed, GatedMLP, Linear, RMSNorm, Rotary

from xlaserve.model_loader.rope import rope_inv_freq
from xlaserve.model_loader.spec import ModelSpec


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, spec: ModelSpec, layer: int, dtype: jnp.dtype) -> None:
        h, eps, off = spec.hidden_size, spec.norm_eps, spec.norm_weight_offset
        self.input_layernorm = RMSNorm(h, eps, dtype, off)
        self.self_attn = Attention(spec, layer, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, off)
        self.mlp = GatedMLP(h, spec.intermediate_size, spec.activation, dtype, spec.mlp_bias)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, kv: KVCache, md: AttentionMetadata
    ) -> tuple[jax.Array, KVCache]:
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, md)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class LlamaForCausalLM(nnx.Module):
    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        if spec.norm_kind != "rms" or not spec.gated_mlp or spec.position_embedding != "rope":
            raise ValueError(
                f"{spec.architecture}: the llama family needs RMSNorm, a gated MLP and rope"
            )
        self.embed_tokens = Embed(spec.vocab_size, spec.hidden_size, dtype)
        self.layers = nnx.List([LlamaDecoderLayer(spec, i, dtype) for i in range(spec.num_layers)])
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps, dtype, spec.norm_weight_offset)
        self.lm_head = (
            None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, dtype)
        )
        self.rotary = Rotary(*rope_inv_freq(spec))
        self.embedding_multiplier = spec.embedding_multiplier
        self.final_logit_softcap = spec.final_logit_softcap
        self.logits_scaling = spec.logits_scaling

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_caches: list[KVCache],
        md: AttentionMetadata,
    ) -> tuple[jax.Array, list[KVCache]]:
        """input_ids, positions [T] -> final hidden states [T, H] and the updated caches."""
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * jnp.asarray(self.embedding_multiplier, x.dtype)
        cos, sin = self.rotary.cos_sin(positions)
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, kv = layer(x, cos, sin, kv, md)
            new_caches.append(kv)
        return self.norm(x), new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [T, H] -> float32 logits [T, V]."""
        logits = (
            self.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        ).astype(jnp.float32)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.final_logit_softcap is not None:
            logits = self.final_logit_softcap * jnp.tanh(logits / self.final_logit_softcap)
        return logits
