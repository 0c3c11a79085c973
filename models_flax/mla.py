"""DeepSeek-V3-style multi-head latent attention (MLA) for the generic decoder (family "mla").

As on the torch backend (backends_torch/models/mla.py), the latent (kv_lora_rank) is expanded to
per-head K [Hq, Dn + Dr] and V [Hq, Dv] before the cache, so the paged cache stores full per-head
K and V (V zero-padded to Dn + Dr) and the ordinary ragged paged attention serves it. Caching the
compressed latent (absorbing kv_b_proj into q / o_proj) is a later optimisation. The adapter
stores rope rows de-interleaved, so the plain neox rotation equals HF's interleaved rope.

Sizes (spec.extra): Rq q_lora_rank (None = plain q_proj), Rkv kv_lora_rank, Dn qk_nope_head_dim,
Dr qk_rope_head_dim, Dv v_head_dim; spec.head_dim = Dn + Dr, spec.num_kv_heads = Hq.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax.attention import AttentionMetadata, KVCache, write_and_attend
from xlaserve.models_flax.layers import Linear, RMSNorm, apply_rotary

# HF's DeepSeek latent norms use their default eps, not rms_norm_eps.
_LATENT_EPS = 1e-6


class MLAttention(nnx.Module):
    """x [T, H] -> [T, H]; cos/sin [T, Dr/2] rotate the Dr rope dims of each head."""

    def __init__(self, spec: ModelSpec, layer: int, dtype: jnp.dtype) -> None:
        ex, h, hq = spec.extra, spec.hidden_size, spec.num_heads
        self.hq = hq
        self.dn, self.dr, self.dv = ex["qk_nope_head_dim"], ex["qk_rope_head_dim"], ex["v_head_dim"]
        self.rkv = ex["kv_lora_rank"]
        dq, rq = self.dn + self.dr, ex.get("q_lora_rank")
        if rq is not None:
            self.q_a_proj = Linear(h, rq, dtype)
            self.q_a_norm = RMSNorm(rq, _LATENT_EPS, dtype)
            self.q_b_proj = Linear(rq, hq * dq, dtype, tp="col")
            self.q_proj = None
        else:
            self.q_proj = Linear(h, hq * dq, dtype, tp="col")
        self.kv_a_proj = Linear(h, self.rkv + self.dr, dtype)
        self.kv_a_norm = RMSNorm(self.rkv, _LATENT_EPS, dtype)
        self.kv_b_proj = Linear(self.rkv, hq * (self.dn + self.dv), dtype, tp="col")
        self.o_proj = Linear(hq * self.dv, h, dtype, tp="row")
        self.sliding_window = spec.layer_sliding_window(layer)
        self.scale = spec.attn_scale if spec.attn_scale is not None else dq**-0.5

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, kv: KVCache, md: AttentionMetadata
    ) -> tuple[jax.Array, KVCache]:
        t, hq, dn, dr, dv = x.shape[0], self.hq, self.dn, self.dr, self.dv
        if self.q_proj is None:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.reshape(t, hq, dn + dr)
        a = self.kv_a_proj(x)  # [T, Rkv + Dr]
        latent, k_rot = a[:, : self.rkv], a[:, self.rkv :]
        kv_nope = self.kv_b_proj(self.kv_a_norm(latent)).reshape(t, hq, dn + dv)
        k_nope, v = kv_nope[..., :dn], kv_nope[..., dn:]
        q_rot = apply_rotary(q[..., dn:], cos, sin)
        k_rot = jnp.broadcast_to(apply_rotary(k_rot.reshape(t, 1, dr), cos, sin), (t, hq, dr))
        q = jnp.concatenate([q[..., :dn], q_rot], axis=-1)
        k = jnp.concatenate([k_nope, k_rot], axis=-1)
        v = jnp.pad(v, ((0, 0), (0, 0), (0, dn + dr - dv)))  # the cache holds D = Dn + Dr
        o, kv = write_and_attend(
            q, k, v, kv, md, sm_scale=self.scale, sliding_window=self.sliding_window, soft_cap=None
        )
        return self.o_proj(o[..., :dv].reshape(t, hq * dv)), kv
