"""Qwen3-Next (`Qwen3NextForCausalLM`) in Flax NNX (the twin of backends_torch/models/qwen3_next.py;
the maths and weight names are model_loader/qwen3_next.py's).

Call contract (the runner's, models_flax/mamba.py): model(input_ids [T], positions [T], caches,
md) -> (final hidden [T, H], updated caches); per layer (K, V) paged blocks for attention layers,
(conv state [S, C, K-1], recurrent state [S, Hv, dk, dv]) float32 for gdn layers;
`md.state_slots` [R] gives each request row's slot (S = padding: its writes are dropped).
GDN layers run the ragged chunked jnp gated delta rule (models_flax/gdn_ops.py: every row advances
one chunk of up to 64 tokens per iteration, the state moving once per chunk; a decode step is
one batched update).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax.attention import Attention, AttentionMetadata, write_and_attend
from xlaserve.models_flax.gdn_ops import (
    gdn_gated_norm,
    gdn_gates,
    gdn_qkv,
    ragged_gated_delta_rule_chunked,
)
from xlaserve.models_flax.layers import (
    Embed,
    Linear,
    RMSNorm,
    _param,
    apply_rotary,
    call_block,
)
from xlaserve.models_flax.mamba import Conv1d
from xlaserve.models_flax.ssm_ops import (
    gather_states,
    ragged_causal_conv1d,
    row_layout,
    scatter_states,
)

StateCache = tuple[jax.Array, jax.Array]


class GatedDeltaNet(nnx.Module):
    """One Gated DeltaNet mixer: x [T, H] -> [T, H], reading and writing its layer's state."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        s = spec.extra["ssm"]
        h = spec.hidden_size
        self.hk, self.hv, self.dk, self.dv = (
            s["n_k_heads"],
            s["n_heads"],
            s["head_dim"],
            s["state_size"],
        )
        self.conv_dim = s["conv_dim"]
        self.eps = spec.norm_eps
        vd = self.hv * self.dv
        self.in_proj_qkvz = Linear(h, self.conv_dim + vd, dtype)
        self.in_proj_ba = Linear(h, 2 * self.hv, dtype)
        self.conv1d = Conv1d(self.conv_dim, s["conv_kernel"], False, dtype)
        self.dt_bias = _param((self.hv,), dtype)
        self.A_log = _param((self.hv,), dtype)
        self.norm = RMSNorm(self.dv, self.eps, dtype)  # weight only (gated norm below)
        self.out_proj = Linear(vd, h, dtype)

    def __call__(
        self, x: jax.Array, cache: StateCache, md: AttentionMetadata
    ) -> tuple[jax.Array, StateCache]:
        conv_c, rec_c = cache
        t = x.shape[0]
        lay = row_layout(md.cu_q_lens, md.kv_lens, t)
        conv0, h0 = gather_states(conv_c, rec_c, md.state_slots, lay.fresh)
        proj = self.in_proj_qkvz(x)
        xbc, z = proj[:, : self.conv_dim], proj[:, self.conv_dim :]
        ba = self.in_proj_ba(x)
        xc, conv1 = ragged_causal_conv1d(
            xbc, self.conv1d.weight[...], None, conv0, lay, md.cu_q_lens
        )
        q, k, v = gdn_qkv(jax.nn.silu(xc), self.hk, self.hv, self.dk, self.dv)
        g, beta = gdn_gates(ba[:, : self.hv], ba[:, self.hv :], self.A_log[...], self.dt_bias[...])
        y, h1 = ragged_gated_delta_rule_chunked(q, k, v, g, beta, h0, lay, md.cu_q_lens)
        out = gdn_gated_norm(
            y, z.reshape(t, self.hv, self.dv), self.norm.weight[...], self.eps, x.dtype
        )
        out = self.out_proj(out.reshape(t, self.hv * self.dv))
        return out, scatter_states(conv_c, rec_c, md.state_slots, conv1, h1)


class GatedAttention(Attention):
    """Attention (qk-norm, partial rotary, paged cache) with its output times
    sigmoid(o_gate_proj(x)) before o_proj."""

    def __init__(self, spec: ModelSpec, layer: int, dtype: jnp.dtype) -> None:
        super().__init__(spec, layer, dtype)
        self.o_gate_proj = Linear(spec.hidden_size, spec.q_size, dtype, spec.qkv_bias, tp="col")

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array | None,
        sin: jax.Array | None,
        kv: tuple,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, tuple]:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o, kv = write_and_attend(q, k, v, kv, md, sm_scale=self.scale,
                                 sliding_window=self.sliding_window, soft_cap=self.soft_cap)  # fmt: skip
        o = o.reshape(t, self.num_heads * self.head_dim)
        gate = jax.nn.sigmoid(self.o_gate_proj(x).astype(jnp.float32)).astype(o.dtype)
        return self.o_proj(o * gate), kv


class Qwen3NextLayer(nnx.Module):
    """x + mixer(norm(x)), then + mlp(norm(x)); the mixer is gated attention or a GDN."""

    def __init__(self, spec: ModelSpec, layer: int, dtype: jnp.dtype) -> None:
        from xlaserve.models_flax.decoder import spec_norm
        from xlaserve.models_flax.layers import GatedMLP
        from xlaserve.models_flax.moe import FusedMoE

        h = spec.hidden_size
        self.attention = spec.extra["layer_kinds"][layer] == "attention"
        self.input_layernorm = spec_norm(spec, h, dtype)
        self.post_attention_layernorm = spec_norm(spec, h, dtype)
        self.self_attn = GatedAttention(spec, layer, dtype) if self.attention else None
        self.linear_attn = None if self.attention else GatedDeltaNet(spec, dtype)
        if spec.is_moe_layer(layer):
            self.mlp = FusedMoE(spec, dtype)
        else:
            self.mlp = GatedMLP(h, spec.intermediate_size, spec.activation, dtype, spec.mlp_bias)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: tuple, md: AttentionMetadata
    ) -> tuple[jax.Array, tuple]:
        h = self.input_layernorm(x)
        if self.attention:
            h, cache = self.self_attn(h, cos, sin, cache, md)
        else:
            h, cache = self.linear_attn(h, cache, md)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Qwen3NextForCausalLM(nnx.Module):
    """Embeddings, Qwen3-Next layers, final (1 + w) RMSNorm, lm_head."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        from xlaserve.model_loader.rope import rope_inv_freq
        from xlaserve.models_flax.decoder import spec_norm
        from xlaserve.models_flax.layers import Rotary

        h = spec.hidden_size
        self.embed_tokens = Embed(spec.vocab_size, h, dtype)
        self.layers = nnx.List([Qwen3NextLayer(spec, i, dtype) for i in range(spec.num_layers)])
        self.norm = spec_norm(spec, h, dtype)
        self.lm_head = None if spec.tie_word_embeddings else Linear(h, spec.vocab_size, dtype)
        self.rotary = Rotary(*rope_inv_freq(spec))

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_caches: list[tuple],
        md: AttentionMetadata,
    ) -> tuple[jax.Array, list[tuple]]:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        new = []
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, cache = call_block(layer, x, cos, sin, cache, md)
            new.append(cache)
        return self.norm(x), new

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [T, H] -> float32 logits [T, V]."""
        head = self.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        return head.astype(jnp.float32)
