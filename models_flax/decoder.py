"""One generic decoder-only transformer built from a ModelSpec (the Flax twin of
backends_torch/models/decoder.py); every dense/MoE family is this module with different spec
fields (the adapters in model_loader/registry.py set them):

- llama (Llama, Mistral, Qwen2/3, Phi3): RMS pre-norms, rope, gated MLP, qkv bias / qk-norm.
- granite: + embedding/residual multipliers, attention multiplier (attn_scale), logits_scaling.
- gemma (Gemma, Gemma2, Gemma3 text): norm offset 1, sqrt(H) embedding scale, sandwich norms,
  attention/final logit soft-caps, per-layer sliding windows, local rope theta.
- olmo2: post (sandwich) norms only, qk-norm over the full projection.
- gpt2 / gpt_neox / starcoder2: LayerNorm with bias, plain MLP, learned positions (gpt2),
  parallel residual and partial rotary (gpt_neox).
- moe (Mixtral, Qwen2-MoE, Qwen3-MoE): FusedMoE (models_flax/moe.py) in place of the MLP.
- mla (DeepSeek-V3): MLA attention (models_flax/mla.py) + FusedMoE.

Attribute names are the canonical weight names of `model_loader/spec.py`
(`layers.{i}.self_attn.q_proj.weight` is `model.layers[i].self_attn.q_proj.weight`).
Call contract (the runner's): model(input_ids [T], positions [T], kv_caches, md) ->
(final hidden [T, H], updated caches); model.compute_logits(hidden [B, H]) -> float32 [B, V].
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model_loader.rope import rope_inv_freq
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax.attention import Attention, AttentionMetadata, KVCache
from xlaserve.models_flax.layers import (
    MLP,
    Embed,
    GatedMLP,
    Linear,
    Rotary,
    call_block,
    make_norm,
)
from xlaserve.models_flax.moe import FusedMoE


def spec_norm(spec: ModelSpec, dim: int, dtype: jnp.dtype) -> nnx.Module:
    return make_norm(
        spec.norm_kind, dim, spec.norm_eps, dtype, spec.norm_weight_offset, spec.norm_bias
    )


def uses_local_rope(spec: ModelSpec, layer: int) -> bool:
    """Sliding layers of a spec with rope_local_theta use plain rope with that theta (Gemma3)."""
    return bool(spec.rope_local_theta) and spec.layer_sliding_window(layer) is not None


class DecoderLayer(nnx.Module):
    """One block: x [T, H] -> x [T, H] (the residual stream), writing its K/V cache."""

    def __init__(self, spec: ModelSpec, layer: int, dtype: jnp.dtype) -> None:
        h = spec.hidden_size
        self.pre_norms, self.sandwich = spec.pre_norms, spec.sandwich_norms
        self.parallel, self.rm = spec.parallel_residual, spec.residual_multiplier
        self.local_rope = uses_local_rope(spec, layer)
        self.use_rope = layer not in spec.nope_layers  # NoPE layers (SmolLM3, Cohere2, ...)
        # Llama 4: NoPE layers scale q by a position-dependent temperature (the model computes it).
        self.temper = not self.use_rope and spec.nope_attn_temperature is not None
        if spec.pre_norms or spec.parallel_residual:
            self.input_layernorm = spec_norm(spec, h, dtype)
            self.post_attention_layernorm = spec_norm(spec, h, dtype)
        if spec.family == "mla":
            from xlaserve.models_flax.mla import MLAttention

            self.self_attn = MLAttention(spec, layer, dtype)
        else:
            self.self_attn = Attention(spec, layer, dtype)
        if spec.sandwich_norms:
            self.post_attn_out_norm = spec_norm(spec, h, dtype)
            self.post_mlp_out_norm = spec_norm(spec, h, dtype)
        if spec.is_moe_layer(layer):
            self.mlp = FusedMoE(spec, dtype)
        elif spec.gated_mlp:
            self.mlp = GatedMLP(h, spec.intermediate_size, spec.activation, dtype, spec.mlp_bias)
        else:
            self.mlp = MLP(h, spec.intermediate_size, spec.activation, dtype, spec.mlp_bias)

    def _scale(self, h: jax.Array) -> jax.Array:
        return h if self.rm == 1.0 else h * jnp.asarray(self.rm, h.dtype)

    def _mlp(self, x: jax.Array, md: AttentionMetadata) -> jax.Array:
        """The MLP; dense ones apply the step's LoRA deltas (MoE experts take none)."""
        if md.lora is not None and isinstance(self.mlp, (GatedMLP, MLP)):
            return self.mlp(x, md.lora)
        return self.mlp(x)

    def __call__(
        self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None, kv: KVCache, md: AttentionMetadata,
        q_scale: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:  # fmt: skip
        """q_scale: float32 [T] (Llama 4 NoPE temperature) for layers that take it, or None."""
        extra = {} if q_scale is None else {"q_scale": q_scale}
        if self.parallel:  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))
            a, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, md, **extra)
            return x + a + self._mlp(self.post_attention_layernorm(x), md), kv
        h = self.input_layernorm(x) if self.pre_norms else x  # OLMo2: raw residual stream
        h, kv = self.self_attn(h, cos, sin, kv, md, **extra)
        if self.sandwich:
            h = self.post_attn_out_norm(h)
        x = x + self._scale(h)
        h = self._mlp(self.post_attention_layernorm(x) if self.pre_norms else x, md)
        if self.sandwich:
            h = self.post_mlp_out_norm(h)
        return x + self._scale(h), kv


class DecoderForCausalLM(nnx.Module):
    """See the module docstring."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        if spec.position_embedding not in ("rope", "learned", "alibi"):
            raise ValueError(f"unknown position_embedding {spec.position_embedding!r}")
        h = spec.hidden_size
        self.embed_tokens = Embed(spec.vocab_size, h, dtype)
        self.embed_positions = (
            Embed(spec.max_position_embeddings, h, dtype)
            if spec.position_embedding == "learned"
            else None
        )
        self.embed_layernorm = spec_norm(spec, h, dtype) if spec.embed_norm else None  # Bloom
        self.layers = nnx.List([DecoderLayer(spec, i, dtype) for i in range(spec.num_layers)])
        self.norm = spec_norm(spec, h, dtype)
        self.lm_head = (
            None
            if spec.tie_word_embeddings
            else Linear(h, spec.vocab_size, dtype, bias=spec.lm_head_bias)
        )
        rotary = local_rotary = None  # assigned once below: nnx fixes an attribute's kind
        if spec.position_embedding == "rope":
            rope_spec = spec
            if spec.family == "mla":  # rope covers the Dr rope dims of each head only
                dr = spec.extra["qk_rope_head_dim"]
                rope_spec = replace(spec, head_dim=dr, partial_rotary_factor=1.0)
            rotary = Rotary(*rope_inv_freq(rope_spec))
            if any(uses_local_rope(spec, i) for i in range(spec.num_layers)):
                local = replace(rope_spec, rope_theta=spec.rope_local_theta, rope_scaling=None)
                local_rotary = Rotary(*rope_inv_freq(local))
        self.rotary, self.local_rotary = rotary, local_rotary
        self.embedding_multiplier = spec.embedding_multiplier
        self.final_logit_softcap = spec.final_logit_softcap
        self.logits_scaling = spec.logits_scaling
        self.temperature = spec.nope_attn_temperature  # (floor_scale, scale) or None; static

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
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        if self.embed_layernorm is not None:
            x = self.embed_layernorm(x)
        rope = {False: (None, None), True: (None, None)}
        if self.rotary is not None:
            rope[False] = self.rotary.cos_sin(positions)
        if self.local_rotary is not None:
            rope[True] = self.local_rotary.cos_sin(positions)
        temp = None
        if self.temperature is not None:  # Llama 4 NoPE layers: 1 + a * log1p(floor((p+1)/F))
            floor_scale, a = self.temperature
            p1 = positions.astype(jnp.float32) + 1.0
            temp = jnp.log1p(jnp.floor(p1 / floor_scale)) * a + 1.0  # [T]
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            cos_sin = rope[layer.local_rope] if layer.use_rope else (None, None)
            x, kv = call_block(layer, x, *cos_sin, kv, md, temp if layer.temper else None)
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
