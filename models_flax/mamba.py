"""Mamba (`MambaForCausalLM`) and Mamba2 (`Mamba2ForCausalLM`) in Flax NNX (the twin of
backends_torch/models/mamba.py; weight names are model_loader/ssm.py's canonical ones).

Call contract (the runner's): model(input_ids [T], positions [T], caches, md) -> (final hidden
[T, H], updated caches), where each layer's cache is (conv state [S, C, K-1], ssm state
[S, Hs, P, N]) float32 and `md.state_slots` [R] gives each request row's slot (S = padding).
Hybrids (HybridForCausalLM: Bamba, Jamba, Granite 4, LFM2, Nemotron-H, Falcon-H1) hold per layer
the cache of its kind (alloc_state_caches; model_loader/ssm.py lists the kinds).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax.attention import AttentionMetadata
from xlaserve.models_flax.layers import Embed, Linear, RMSNorm, _param, call_block
from xlaserve.models_flax.ssm_ops import (
    gather_states,
    ragged_causal_conv1d,
    ragged_selective_scan,
    row_layout,
    scatter_states,
)

StateCache = tuple[jax.Array, jax.Array]


class Conv1d(nnx.Module):
    def __init__(self, channels: int, k: int, bias: bool, dtype: jnp.dtype) -> None:
        self.weight = _param((channels, k), dtype)
        self.bias = _param((channels,), dtype) if bias else None


class SSMMixer(nnx.Module):
    """One Mamba / Mamba2 mixer: x [T, H] -> [T, H], reading and writing its layer's state."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        s = spec.extra["ssm"]
        self.kind = s["kind"]
        h, i, n, g = spec.hidden_size, s["d_inner"], s["state_size"], s["n_groups"]
        self.d_inner, self.n, self.groups = i, n, g
        self.hs, self.p = s["n_heads"], s["head_dim"]
        self.dt_limit = tuple(float(v) for v in s["dt_limit"])
        self.eps = spec.norm_eps
        bias = s["proj_bias"]
        # Output gate of Mamba2: "gated" norm(y * silu(z)); Falcon-H1 also "norm_gate"
        # (norm(y) * silu(z)) and "none" (y * silu(z), no norm weight).
        self.gate_norm = s.get("gate_norm", "gated")
        if self.kind == "mamba2":
            self.conv_dim = i + 2 * g * n
            self.in_proj = Linear(h, i + self.conv_dim + self.hs, dtype, bias)
            self.dt_bias = _param((self.hs,), dtype)
            self.A_log = _param((self.hs,), dtype)
            # weight only (gated norm below); none for Falcon-H1 without mamba_rms_norm
            self.norm = RMSNorm(i, self.eps, dtype) if self.gate_norm != "none" else None
        else:
            self.conv_dim = i
            self.rank = s["dt_rank"]
            self.in_proj = Linear(h, 2 * i, dtype, bias)
            self.x_proj = Linear(i, self.rank + 2 * n, dtype)
            self.dt_proj = Linear(self.rank, i, dtype, bias=True)
            self.A_log = _param((i, n), dtype)
            if s.get("bc_norms"):  # Jamba: RMS norms on dt (rank R), B and C (N)
                self.dt_layernorm = RMSNorm(self.rank, self.eps, dtype)
                self.b_layernorm = RMSNorm(n, self.eps, dtype)
                self.c_layernorm = RMSNorm(n, self.eps, dtype)
        self.bc_norms = bool(s.get("bc_norms"))
        self.conv1d = Conv1d(self.conv_dim, s["conv_kernel"], s["conv_bias"], dtype)
        self.D = _param((self.hs,), dtype)
        self.out_proj = Linear(i, h, dtype, s.get("out_bias", bias))

    def __call__(
        self, x: jax.Array, cache: StateCache, md: AttentionMetadata
    ) -> tuple[jax.Array, StateCache]:
        conv_c, ssm_c = cache
        t = x.shape[0]
        lay = row_layout(md.cu_q_lens, md.kv_lens, t)
        conv0, h0 = gather_states(conv_c, ssm_c, md.state_slots, lay.fresh)
        proj = self.in_proj(x)
        i = self.d_inner
        if self.kind == "mamba2":
            z, xbc, dt_raw = jnp.split(proj, [i, i + self.conv_dim], axis=-1)
        else:
            xbc, z = jnp.split(proj, [i], axis=-1)
        bias = None if self.conv1d.bias is None else self.conv1d.bias[...]
        xc, conv1 = ragged_causal_conv1d(
            xbc, self.conv1d.weight[...], bias, conv0, lay, md.cu_q_lens
        )
        xc = jax.nn.silu(xc)
        if self.kind == "mamba2":
            gn = self.groups * self.n
            xs, B, C = jnp.split(xc, [i, i + gn], axis=-1)
            rep = self.hs // self.groups
            B = jnp.repeat(B.reshape(t, self.groups, self.n), rep, axis=1)
            C = jnp.repeat(C.reshape(t, self.groups, self.n), rep, axis=1)
            dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
            lo, hi = self.dt_limit
            if lo > 0.0 or hi != float("inf"):
                dt = jnp.clip(dt, lo, hi)
            A = -jnp.exp(self.A_log[...].astype(jnp.float32))[:, None, None]
            xs = xs.reshape(t, self.hs, self.p)
        else:
            dbc = self.x_proj(xc.astype(x.dtype))
            dtr, B, C = jnp.split(dbc, [self.rank, self.rank + self.n], axis=-1)
            if self.bc_norms:
                dtr, B, C = self.dt_layernorm(dtr), self.b_layernorm(B), self.c_layernorm(C)
            dtr, B, C = (v.astype(jnp.float32) for v in (dtr, B, C))
            w, b = self.dt_proj.weight[...].astype(jnp.float32), self.dt_proj.bias[...]
            dt = jax.nn.softplus(dtr @ w.T + b.astype(jnp.float32))
            A = -jnp.exp(self.A_log[...].astype(jnp.float32))[:, None, :]
            xs, B, C = xc[:, :, None], B[:, None, :], C[:, None, :]
        y, h1 = ragged_selective_scan(xs, dt, A, B, C, self.D[...], h0, lay, md.cu_q_lens)
        y = y.reshape(t, i)
        if self.kind == "mamba2" and self.gate_norm == "gated":  # RMS norm over each group
            yz = y * jax.nn.silu(z.astype(jnp.float32))
            yg = yz.reshape(t, self.groups, i // self.groups)
            yg = yg * jax.lax.rsqrt(jnp.mean(yg * yg, axis=-1, keepdims=True) + self.eps)
            w = self.norm.weight[...]
            y = w * yg.reshape(t, i).astype(w.dtype)
        elif self.gate_norm == "norm_gate":  # Falcon-H1 mamba_norm_before_gate
            yg = y.reshape(t, self.groups, i // self.groups)
            yg = yg * jax.lax.rsqrt(jnp.mean(yg * yg, axis=-1, keepdims=True) + self.eps)
            w = self.norm.weight[...].astype(jnp.float32)
            y = w * yg.reshape(t, i) * jax.nn.silu(z.astype(jnp.float32))
        else:
            y = y * jax.nn.silu(z.astype(jnp.float32))
        out = self.out_proj(y.astype(x.dtype))
        return out, scatter_states(conv_c, ssm_c, md.state_slots, conv1, h1)


class SSMLayer(nnx.Module):
    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps, dtype)
        self.mixer = SSMMixer(spec, dtype)
        self.fp32 = bool(spec.extra["ssm"]["residual_in_fp32"])

    def __call__(
        self, x: jax.Array, cache: StateCache, md: AttentionMetadata
    ) -> tuple[jax.Array, StateCache]:
        h, cache = self.mixer(self.norm(x.astype(self.norm.weight[...].dtype)), cache, md)
        res = x.astype(jnp.float32) if self.fp32 else x
        return res + h.astype(res.dtype), cache


class MambaForCausalLM(nnx.Module):
    """See the module docstring."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        h = spec.hidden_size
        self.embed_tokens = Embed(spec.vocab_size, h, dtype)
        self.layers = nnx.List([SSMLayer(spec, dtype) for _ in range(spec.num_layers)])
        self.norm = RMSNorm(h, spec.norm_eps, dtype)
        self.lm_head = None if spec.tie_word_embeddings else Linear(h, spec.vocab_size, dtype)
        self.dtype = dtype

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_caches: list[StateCache],
        md: AttentionMetadata,
    ) -> tuple[jax.Array, list[StateCache]]:
        x = self.embed_tokens(input_ids)
        new = []
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, cache = call_block(layer, x, cache, md)
            new.append(cache)
        return self.norm(x.astype(self.dtype)), new

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [T, H] -> float32 logits [T, V]."""
        head = self.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        return head.astype(jnp.float32)


def alloc_state_caches(
    runner: object, num_blocks: int, num_slots: int
) -> list[tuple[jax.Array, ...]]:
    """Per layer: attention (K, V) [N, S, Hkv, D] in the KV dtype; state layers (conv
    [slots, C, K-1], ssm [slots, Hs, P, N]) float32; Falcon-H1's "parallel" layers
    ((K, V), (conv, ssm)); Nemotron-H's "mlp" layers two empty arrays; zeros, replicated."""
    from xlaserve.model_loader.ssm import state_shapes

    spec = runner.spec
    kinds = spec.extra.get("layer_kinds") or ["attention"] * spec.num_layers
    (c, k1), (hs, p, n) = state_shapes(spec)
    kv_shape = (num_blocks, runner.block_size, spec.num_kv_heads, spec.head_dim)

    def kv() -> tuple[jax.Array, jax.Array]:
        return jnp.zeros(kv_shape, runner.kv_dtype), jnp.zeros(kv_shape, runner.kv_dtype)

    def state() -> tuple[jax.Array, jax.Array]:
        return jnp.zeros((num_slots, c, k1), jnp.float32), jnp.zeros(
            (num_slots, hs, p, n), jnp.float32
        )

    out: list[tuple] = []
    for kind in kinds:
        if kind == "attention":
            out.append(kv())
        elif kind == "parallel":
            out.append((kv(), state()))
        elif kind == "mlp":
            out.append((jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32)))
        else:
            out.append(state())
    return jax.device_put(out, runner._replicated)


class ShortConvMixer(nnx.Module):
    """LFM2's gated short convolution (the twin of backends_torch/models/mamba.py's):
    x [T, H] -> [T, H], y = C * conv(B * x) with the conv window in the rows' slots."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        s, h = spec.extra["ssm"], spec.hidden_size
        self.in_proj = Linear(h, 3 * h, dtype, s["proj_bias"])
        self.conv1d = Conv1d(h, s["conv_kernel"], s["conv_bias"], dtype)
        self.out_proj = Linear(h, h, dtype, s["proj_bias"])

    def __call__(
        self, x: jax.Array, cache: StateCache, md: AttentionMetadata
    ) -> tuple[jax.Array, StateCache]:
        conv_c, ssm_c = cache
        lay = row_layout(md.cu_q_lens, md.kv_lens, x.shape[0])
        conv0, h0 = gather_states(conv_c, ssm_c, md.state_slots, lay.fresh)
        b_gate, c_gate, xs = jnp.split(self.in_proj(x), 3, axis=-1)
        bias = None if self.conv1d.bias is None else self.conv1d.bias[...]
        y, conv1 = ragged_causal_conv1d(
            b_gate * xs, self.conv1d.weight[...], bias, conv0, lay, md.cu_q_lens
        )
        out = self.out_proj(c_gate * y.astype(x.dtype))
        return out, scatter_states(conv_c, ssm_c, md.state_slots, conv1, h0)


class HybridLayer(nnx.Module):
    """One hybrid block by spec.extra["layer_kinds"] (the twin of backends_torch's HybridLayer):
    x + mixer(norm(x)), then + mlp(norm(x)), the mixer paged attention, an SSM mixer or LFM2's
    short convolution; "parallel" (Falcon-H1): x + ssm(n) + attention(n); spec.extra
    ["single_mixer"] (Nemotron-H): x + mixer(norm(x)) only, the mixer possibly the MLP."""

    def __init__(self, spec: ModelSpec, layer: int, dtype: jnp.dtype) -> None:
        from xlaserve.models_flax.attention import Attention
        from xlaserve.models_flax.decoder import spec_norm
        from xlaserve.models_flax.layers import MLP, GatedMLP

        h = spec.hidden_size
        self.kind = kind = spec.extra["layer_kinds"][layer]
        self.single = bool(spec.extra.get("single_mixer"))
        self.attention = kind in ("attention", "parallel")
        self.input_layernorm = spec_norm(spec, h, dtype)
        self.post_attention_layernorm = None if self.single else spec_norm(spec, h, dtype)
        self.self_attn = Attention(spec, layer, dtype) if self.attention else None
        if kind in ("mamba", "mamba2", "parallel"):
            self.mixer = SSMMixer(spec, dtype)
        else:
            self.mixer = ShortConvMixer(spec, dtype) if kind == "shortconv" else None
        if self.single and kind != "mlp":  # Nemotron-H: the layer's one mixer is not an MLP
            self.mlp = None
        elif spec.is_moe_layer(layer):  # GraniteMoeHybrid: MoE + the shared MLP as shared expert
            from xlaserve.models_flax.moe import FusedMoE

            self.mlp = FusedMoE(spec, dtype)
        elif spec.gated_mlp:
            self.mlp = GatedMLP(h, spec.intermediate_size, spec.activation, dtype, spec.mlp_bias)
        else:
            self.mlp = MLP(h, spec.intermediate_size, spec.activation, dtype, spec.mlp_bias)
        self.rm = spec.residual_multiplier

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: tuple, md: AttentionMetadata
    ) -> tuple[jax.Array, tuple]:
        h = self.input_layernorm(x)
        if self.kind == "mlp":
            h = self.mlp(h)
        elif self.kind == "parallel":  # Falcon-H1 (multipliers folded into the weights)
            kv, state = cache
            m, state = self.mixer(h, state, md)
            a, kv = self.self_attn(h, cos, sin, kv, md)
            h, cache = m + a, (kv, state)
        elif self.attention:
            h, cache = self.self_attn(h, cos, sin, cache, md)
        else:
            h, cache = self.mixer(h, cache, md)
        rm = jnp.asarray(self.rm, x.dtype)
        x = x + (h * rm if self.rm != 1.0 else h)
        if self.single:
            return x, cache
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h * rm if self.rm != 1.0 else h), cache


class HybridForCausalLM(nnx.Module):
    """Attention + state-space hybrids (Bamba, Jamba, Granite 4, LFM2, Nemotron-H, Falcon-H1):
    per layer the cache of its kind (alloc_state_caches)."""

    def __init__(self, spec: ModelSpec, dtype: jnp.dtype) -> None:
        from xlaserve.model_loader.rope import rope_inv_freq
        from xlaserve.models_flax.decoder import spec_norm
        from xlaserve.models_flax.layers import Rotary

        h = spec.hidden_size
        self.embed_tokens = Embed(spec.vocab_size, h, dtype)
        self.layers = nnx.List([HybridLayer(spec, i, dtype) for i in range(spec.num_layers)])
        self.norm = spec_norm(spec, h, dtype)
        self.lm_head = None if spec.tie_word_embeddings else Linear(h, spec.vocab_size, dtype)
        self.rotary = Rotary(*rope_inv_freq(spec)) if spec.position_embedding == "rope" else None
        self.embedding_multiplier = spec.embedding_multiplier
        self.logits_scaling = spec.logits_scaling

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_caches: list[tuple],
        md: AttentionMetadata,
    ) -> tuple[jax.Array, list[tuple]]:
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * jnp.asarray(self.embedding_multiplier, x.dtype)
        cos, sin = self.rotary.cos_sin(positions) if self.rotary is not None else (None, None)
        new = []
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, cache = call_block(layer, x, cos, sin, cache, md)
            new.append(cache)
        return self.norm(x), new

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [T, H] -> float32 logits [T, V]."""
        head = self.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)
        return head.astype(jnp.float32) / self.logits_scaling
