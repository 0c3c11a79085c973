"""Gated delta rule kernels (Qwen3-Next Gated DeltaNet layers) in Pallas (TPU; tested in TPU
interpret mode on the CPU against models_flax/gdn_ops.py's sequential recurrence).

- `gdn_chunked_prefill`: one request's T tokens from state h0, one program per head, the tokens in
  chunks of `chunk` rows (T padded with g = beta = 0 rows, which change nothing). Inside a chunk
  the WY form of gdn_ops.gated_delta_rule_chunked, with only matmuls / elementwise ops (TPU
  friendly): the cumulative log decay as a lower-triangular-ones matmul, and the inverse of the
  unit lower triangular M = I - N as the product (I + N)(I + N^2)(I + N^4)... (N is nilpotent).
  The state h [dk, dv] is carried across chunks in the loop. Returns (y [T, H, dv], h_T).
- `gdn_decode_update`: one token per request; the state of slot slots[b] is read, updated and
  written back IN PLACE in the slot cache [S, H, dk, dv] (aliased input -> output; slots come in
  as a scalar prefetch so each program DMAs only its own state). keep[b] = 0 starts from zeros.
  Slots must be distinct and < S (padding rows are the caller's to drop).
q / k already l2-normalised (q scaled by dk^-0.5) and repeated to H value heads; float32 maths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from xlaserve.kernels_pallas.compat import PrefetchScalarGridSpec


def _tri(n: int, strict: bool) -> jax.Array:
    """[n, n] float32 lower-triangular mask (with or without the diagonal)."""
    r = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return jnp.where(r > c if strict else r >= c, 1.0, 0.0).astype(jnp.float32)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def _dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b^T."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=jax.lax.Precision.HIGHEST)  # fmt: skip


def _chunk_kernel(q_ref, k_ref, v_ref, gc_ref, gr_ref, b_ref, h0_ref, y_ref, ht_ref, *, bt, n):  # noqa: ANN001, ANN202
    lower = _tri(bt, strict=False)
    strict = _tri(bt, strict=True)
    eye = lower - strict
    steps = max(1, (bt - 1).bit_length())  # N^(2^steps) = 0 for a [bt, bt] strictly lower N

    def body(c, h):  # noqa: ANN001, ANN202
        rows = pl.ds(pl.multiple_of(c * bt, bt), bt)
        q, k, v = q_ref[0, rows, :], k_ref[0, rows, :], v_ref[0, rows, :]
        beta = b_ref[0, rows, :]  # [bt, 1]
        gcol = _dot(lower, gc_ref[0, rows, :])  # [bt, 1] cumulative log decay
        grow = _dot_t(gr_ref[0, :, rows], lower)  # [1, bt] the same as a row
        decay = jnp.exp(jnp.minimum(gcol - grow, 0.0)) * lower  # [bt, bt]
        kb = k * beta
        nmat = -_dot_t(kb, k) * decay * strict  # M = I - N
        inv, p = eye + nmat, nmat
        for _ in range(steps - 1):
            p = _dot(p, p)
            inv = _dot(inv, eye + p)
        u = _dot(inv, v * beta)
        w = _dot(inv, kb * jnp.exp(gcol))
        vn = u - _dot(w, h)
        y = _dot(q * jnp.exp(gcol), h) + _dot(_dot_t(q, k) * decay, vn)
        y_ref[0, rows, :] = y
        g_last = gcol[bt - 1 : bt, :]  # [1, 1]
        kd = k * jnp.exp(g_last - gcol)
        return jnp.exp(g_last) * h + jax.lax.dot_general(
            kd, vn, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
            precision=jax.lax.Precision.HIGHEST,
        )  # fmt: skip

    ht_ref[0] = jax.lax.fori_loop(0, n, body, h0_ref[0].astype(jnp.float32))


def gdn_chunked_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    h0: jax.Array,
    chunk: int = 16,
) -> tuple[jax.Array, jax.Array]:
    """q / k [T, H, dk], v [T, H, dv], g / beta [T, H], h0 [H, dk, dv] -> (y [T, H, dv],
    h_T [H, dk, dv]) float32."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    tp = t + pad

    def hm(a: jax.Array) -> jax.Array:  # [T, H, ...] -> head-major [H, Tp, ...] float32
        a = jnp.pad(a.astype(jnp.float32), [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return jnp.moveaxis(a, 1, 0)

    qh, kh, vh = hm(q), hm(k), hm(v)
    gh, bh = hm(g)[..., None], hm(beta)[..., None]  # [H, Tp, 1]
    seq = lambda d: pl.BlockSpec((1, tp, d), lambda i: (i, 0, 0))  # noqa: E731
    y, ht = pl.pallas_call(
        functools.partial(_chunk_kernel, bt=chunk, n=tp // chunk),
        grid=(h,),
        in_specs=[
            seq(dk),
            seq(dk),
            seq(dv),
            seq(1),
            pl.BlockSpec((1, 1, tp), lambda i: (i, 0, 0)),
            seq(1),
            pl.BlockSpec((1, dk, dv), lambda i: (i, 0, 0)),
        ],  # fmt: skip
        out_specs=[seq(dv), pl.BlockSpec((1, dk, dv), lambda i: (i, 0, 0))],
        out_shape=[
            jax.ShapeDtypeStruct((h, tp, dv), jnp.float32),
            jax.ShapeDtypeStruct((h, dk, dv), jnp.float32),
        ],  # fmt: skip
    )(qh, kh, vh, gh, jnp.swapaxes(gh, 1, 2), bh, h0.astype(jnp.float32))
    return jnp.moveaxis(y, 0, 1)[:t], ht


def _decode_kernel(slots_ref, keep_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h_ref, y_ref, ho_ref):  # noqa: ANN001, ANN202
    del slots_ref  # used by the index maps only
    st = h_ref[0, 0] * keep_ref[0, 0]  # [dk, dv]
    q, k, v = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0]  # [1, dk], [1, dk], [1, dv]
    st = st * jnp.exp(g_ref[0, 0])
    kv = _dot(k, st)  # [1, dv]
    st = st + jax.lax.dot_general(k, (v - kv) * b_ref[0, 0], (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32,
                                  precision=jax.lax.Precision.HIGHEST)  # fmt: skip
    ho_ref[0, 0] = st
    y_ref[0, 0] = _dot(q, st)


def gdn_decode_update(
    cache: jax.Array,
    slots: jax.Array,
    keep: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """cache [S, H, dk, dv] float32, slots [B] int32 (distinct, < S), keep [B] float32,
    q / k [B, H, dk], v [B, H, dv], g / beta [B, H] -> (y [B, H, dv] float32, the updated cache;
    the input cache buffer is reused in place)."""
    bsz, h, dk = q.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    q4, k4, v4 = (a.astype(f32)[:, :, None, :] for a in (q, k, v))
    g4, b4 = (a.astype(f32)[:, :, None, None] for a in (g, beta))
    keep4 = keep.astype(f32)[:, None, None, None]
    row = lambda d: pl.BlockSpec((1, 1, 1, d), lambda b, i, s: (b, i, 0, 0))  # noqa: E731
    state = pl.BlockSpec((1, 1, dk, dv), lambda b, i, s: (s[b], i, 0, 0))
    y, cache = pl.pallas_call(
        _decode_kernel,
        grid_spec=PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(bsz, h),
            in_specs=[
                pl.BlockSpec((1, 1, 1, 1), lambda b, i, s: (b, 0, 0, 0)),
                row(dk),
                row(dk),
                row(dv),
                row(1),
                row(1),
                state,
            ],  # fmt: skip
            out_specs=[row(dv), state],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((bsz, h, 1, dv), f32),
            jax.ShapeDtypeStruct(cache.shape, f32),
        ],  # fmt: skip
        input_output_aliases={7: 1},  # cache (after the scalar-prefetch slots) -> output 1
    )(slots.astype(jnp.int32), keep4, q4, k4, v4, g4, b4, cache)
    return y[:, :, 0, :], cache
