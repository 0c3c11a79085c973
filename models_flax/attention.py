"""Attention over the paged KV cache: projections, qk-norm, rotary, cache write, ragged kernel.

The kernel contract is `xlaserve.kernels_pallas.ragged_paged_attention` (write_kv +
ragged_paged_attention). Under tensor parallelism with KV heads divisible by the mesh, the kernel
runs inside `shard_map` over the "model" axis (heads are independent, so each device attends
with its own heads and cache shard); otherwise GSPMD partitions the surrounding ops.

Quantized KV cache (kv_cache_dtype "int8" / "fp8", xlaserve.quantization.kv_quant): the layer's
cache tuple is (k codes, v codes, k scales [N, S, Hkv], v scales) instead of (k, v); this step's
K/V are quantized per token and KV head as they are written (`write_kv_quant`), and the kernel
dequantizes what it reads. The scales are sharded over KV heads like the codes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xlaserve.config import kernel_switch
from xlaserve.kernels_pallas import ragged_paged_attention, write_kv
from xlaserve.kernels_pallas.ragged_paged_attention import (
    ref_ragged_paged_attention,
    write_kv_quant,
)
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax.layers import (
    Linear,
    _param,
    apply_rotary,
    lora_linear,
    make_norm,
    sibling_linears,
)

# (k, v), each [N, S, Hkv, D]; quantized cache: (k codes, v codes, k scales, v scales), codes
# [N, S, Hkv, D] int8 / float8_e4m3fn, scales float32 [N, S, Hkv].
KVCache = tuple[jax.Array, ...]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "slot_mapping",
        "kv_lens",
        "block_tables",
        "cu_q_lens",
        "num_seqs",
        "state_slots",
        "lora",
    ],
    meta_fields=["mesh", "impl"],
)
@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step batch layout shared by every layer (arrays traced; mesh/impl static)."""

    slot_mapping: (
        jax.Array
    )  # int32 [T]: cache slot (page * S + offset) of each token, < 0 = padding
    kv_lens: jax.Array  # int32 [B]: context length incl. this step's tokens (0 = padding request)
    block_tables: jax.Array  # int32 [B, M]: pages of each request
    cu_q_lens: jax.Array  # int32 [B+1]: start of each request's tokens in T
    num_seqs: jax.Array  # int32 [1]: real requests (rows past it are padding)
    mesh: Mesh | None = None  # static: the device mesh (axis "model") or None
    # static: kernel implementation, KernelConfig.rpa_impl (the runner passes it; built on its
    # own: the default and its XLASERVE_RPA_IMPL override): "auto" | "reference" | "chunked_xla" |
    # "pallas_tpu" | "pallas_gpu" (see ragged_paged_attention).
    impl: str = field(default_factory=lambda: kernel_switch("rpa_impl"))
    # int32 [B]: recurrent-state slot of each request row (state-space models, models_flax/mamba.py;
    # padding rows hold the slot count: their writes are dropped); None for attention-only models.
    state_slots: jax.Array | None = None
    # Multi-LoRA (layers.LoRAStep: each token's adapter slot, grouped): None = no LoRA this
    # program. Projections with slot tables add their deltas (layers.lora_linear).
    lora: Any = None


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
) -> jax.Array:
    """q [T, Hq, D] over caches [N, S, Hkv, D] -> [T, Hq, D]. k_scale, v_scale: float32
    [N, S, Hkv] for an int8 / fp8 cache (None for a float cache). alibi_slopes [Hq] (ALiBi) and
    sinks [Hq] (attention sinks): only the jnp reference implements them (Bloom, MPT, gpt-oss
    run it on every platform). chunk_size: chunked attention (Llama 4), every kernel."""
    if alibi_slopes is not None or sinks is not None:
        return ref_ragged_paged_attention(
            q, k_cache, v_cache, md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes, sinks=sinks,
            chunk_size=chunk_size,
        )  # fmt: skip
    call = functools.partial(
        ragged_paged_attention,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        impl=md.impl,
        chunk_size=chunk_size,
    )
    if k_scale is None and q.dtype != k_cache.dtype:  # float32 cache of a 16-bit model (CPU)
        out = paged_attention(
            q.astype(k_cache.dtype), k_cache, v_cache, md,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            chunk_size=chunk_size,
        )  # fmt: skip
        return out.astype(q.dtype)
    mesh = md.mesh
    tp = 1 if mesh is None else mesh.shape["model"]
    meta = (md.kv_lens, md.block_tables, md.cu_q_lens, md.num_seqs)
    scales = () if k_scale is None else (k_scale, v_scale)
    if tp == 1 or k_cache.shape[2] % tp or q.shape[1] % tp:
        return call(q, k_cache, v_cache, *meta, *scales)
    heads, cache, rep = P(None, "model", None), P(None, None, "model", None), P()
    scale_specs = (P(None, None, "model"),) * len(scales)  # scales split with their heads
    sharded = jax.shard_map(
        call,
        mesh=mesh,
        in_specs=(heads, cache, cache, rep, rep, rep, rep, *scale_specs),
        out_specs=heads,
        check_vma=False,
    )
    return sharded(q, k_cache, v_cache, *meta, *scales)


def write_and_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv: KVCache,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    alibi_slopes: jax.Array | None = None,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
) -> tuple[jax.Array, KVCache]:
    """Write this step's k, v [T, Hkv, D] into the layer's cache (quantizing them for an int8 /
    fp8 cache), then attend with q [T, Hq, D]. Returns ([T, Hq, D], the updated cache)."""
    if len(kv) == 4:  # quantized cache: (k codes, v codes, k scales, v scales)
        kv = write_kv_quant(*kv, k, v, md.slot_mapping)
    else:
        kv = write_kv(kv[0], kv[1], k, v, md.slot_mapping)
    o = paged_attention(
        q,
        kv[0],
        kv[1],
        md,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=kv[2] if len(kv) == 4 else None,
        v_scale=kv[3] if len(kv) == 4 else None,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        chunk_size=chunk_size,
    )
    return o, kv


class Attention(nnx.Module):
    """Self-attention of one layer: [T, H] -> [T, H], writing this step's K/V into the cache."""

    def __init__(self, spec: ModelSpec, layer: int, dtype: jnp.dtype) -> None:
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = Linear(h, spec.num_heads * d, dtype, spec.qkv_bias, tp="col")
        self.k_proj = Linear(h, spec.num_kv_heads * d, dtype, spec.qkv_bias, tp="col")
        self.v_proj = Linear(h, spec.num_kv_heads * d, dtype, spec.qkv_bias, tp="col")
        self.o_proj = Linear(spec.num_heads * d, h, dtype, spec.o_bias, tp="row")
        qk_norm = spec.layer_qk_norm(layer)
        self.full_qk_norm = qk_norm and spec.qk_norm_scope == "full"
        if qk_norm:  # "head": over each head's D dims; "full": over the whole projection
            qd, kd = (spec.q_size, spec.kv_size) if self.full_qk_norm else (d, d)
            norm = (spec.norm_kind, spec.norm_eps, dtype, spec.norm_weight_offset, spec.norm_bias)
            self.q_norm = make_norm(norm[0], qd, *norm[1:])
            self.k_norm = make_norm(norm[0], kd, *norm[1:])
        else:
            self.q_norm = self.k_norm = None
        self.sliding_window = spec.layer_sliding_window(layer)
        self.chunk_size = spec.layer_chunk_size(layer)  # Llama 4 chunked attention
        self.soft_cap = spec.attn_logit_softcap
        self.scale = spec.attn_scale if spec.attn_scale is not None else d**-0.5
        # Static (a tuple, not an array attribute: nnx would treat an array as state).
        self.alibi = tuple(spec.alibi_slopes) if spec.alibi_slopes is not None else None
        # gpt-oss attention sinks: one learned logit per query head [Hq] (float32).
        self.sinks = _param((spec.num_heads,), jnp.float32) if spec.attn_sinks else None

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array | None,
        sin: jax.Array | None,
        kv: KVCache,
        md: AttentionMetadata,
        q_scale: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """x [T, H]; cos/sin [T, R/2] (None: no rope, e.g. learned positions) -> [T, H].
        q_scale: float32 [T] multiplying q (Llama 4 NoPE-layer temperature), or None."""
        t = x.shape[0]
        lo = md.lora
        q, k, v = sibling_linears((self.q_proj, self.k_proj, self.v_proj), x, lo)
        if self.full_qk_norm:  # OLMo2: normalise before the head split
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if q_scale is not None:
            q = (q * q_scale[:, None, None]).astype(v.dtype)
        alibi = None if self.alibi is None else jnp.asarray(self.alibi, jnp.float32)
        o, kv = write_and_attend(
            q, k, v, kv, md,
            sm_scale=self.scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap,
            alibi_slopes=alibi, sinks=None if self.sinks is None else self.sinks[...],
            chunk_size=self.chunk_size,
        )  # fmt: skip
        return lora_linear(self.o_proj, o.reshape(t, self.num_heads * self.head_dim), lo), kv
