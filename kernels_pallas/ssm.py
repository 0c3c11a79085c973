"""Decode-step and prefill kernels of state-space layers (Mamba, Mamba2) in Pallas (TPU; tested in TPU
interpret mode on the CPU), with plain jnp references. The Pallas twins of kernels_cuda/ssm.py,
with the same contracts and the same float32 maths:

- `conv_state_update`: x [B, C] one new conv input per request; conv cache [S, C, K-1] float32,
  row slots[b]; y = sum_k w[:, k] * window[:, k] + bias with window = (state, x); the state shifts
  left by one and x becomes its last column. keep[b] = 0 starts request b from a zero state (a
  fresh request's first token).
- `ssm_state_update`: h [Hs, P, N] of slot slots[b] <- exp(dt * A) * h + dt * x (x) B;
  y = h . C + D * x. A [Hs, N] (Mamba1) or [Hs] (Mamba2: one value per head, broadcast over N),
  B / C [B, G, N] with head h reading group h // (Hs / G). dt comes in already processed
  (dt_bias added and softplus'd by the caller, as for the Triton twin).

Both read and write each request's state IN PLACE in the slot cache: the cache is aliased input ->
output (input_output_aliases) and the slots come in as a scalar prefetch, so each program DMAs only
its own slot's rows; rows of other slots are never touched. Slots must be distinct and < S (padding
rows are the caller's to drop). y is float32.

Prefill, one request's T tokens (the twins of kernels_cuda/ssm_prefill.py, same contracts):
- `causal_conv1d_prefill`: x [T, C] from state [C, K-1] -> (y [T, C], the last K-1 inputs of
  (state, x[:length])); C blocks on the lanes.
- `ssd_chunked_prefill`: Mamba2's chunked scan, one program per head, chunks of matmuls (the
  cumulative log decay as a lower-triangular matmul, as in gdn.py), the state carried across
  chunks in a fori_loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from xlaserve.kernels_pallas.compat import PrefetchScalarGridSpec

_F32 = jnp.float32


# --- causal conv1d, one step ------------------------------------------------------------------


def _conv_kernel(slots_ref, keep_ref, x_ref, w_ref, b_ref, st_ref, y_ref, so_ref, *, k: int):  # noqa: ANN001, ANN202
    del slots_ref  # used by the index maps only
    keep = keep_ref[0]  # [1, 1]
    st = st_ref[0] * keep  # [C, K-1]
    x = x_ref[0]  # [C, 1]
    w = w_ref[...]  # [C, K]
    # Same order as the Triton twin: the newest column first, then the state's columns.
    acc = x * w[:, k - 1 : k]
    for j in range(k - 1):
        acc = acc + st[:, j : j + 1] * w[:, j : j + 1]
    for j in range(1, k - 1):  # shift left by one
        so_ref[0, :, j - 1 : j] = st[:, j : j + 1]
    so_ref[0, :, k - 2 : k - 1] = x
    y_ref[0] = acc + b_ref[...]


def conv_state_update(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    state: jax.Array,
    slots: jax.Array,
    keep: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """x [B, C], weight [C, K] (K >= 2), bias [C] | None, state [S, C, K-1] float32,
    slots [B] int32 (distinct, < S), keep [B] float32 -> (y [B, C] float32 before the activation,
    the updated state; the input state buffer is reused in place)."""
    bsz, c = x.shape
    k = weight.shape[1]
    if state.dtype != _F32 or state.ndim != 3 or state.shape[1:] != (c, k - 1) or k < 2:
        raise ValueError(
            f"conv_state_update: state must be float32 [S, {c}, {k - 1}] with K >= 2, "
            f"got {state.dtype} {tuple(state.shape)}"
        )
    if weight.shape[0] != c or slots.shape != (bsz,) or keep.shape != (bsz,):
        raise ValueError("conv_state_update: weight [C, K], slots [B] and keep [B] expected")
    b2 = jnp.zeros((c, 1), _F32) if bias is None else bias.astype(_F32).reshape(c, 1)
    x3 = x.astype(_F32)[:, :, None]  # [B, C, 1]: C on sublanes like the state rows
    keep3 = keep.astype(_F32)[:, None, None]
    col = pl.BlockSpec((1, c, 1), lambda b, s: (b, 0, 0))
    rows = pl.BlockSpec((1, c, k - 1), lambda b, s: (s[b], 0, 0))
    y, state = pl.pallas_call(
        lambda *refs: _conv_kernel(*refs, k=k),
        grid_spec=PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(bsz,),
            in_specs=[
                pl.BlockSpec((1, 1, 1), lambda b, s: (b, 0, 0)),
                col,
                pl.BlockSpec((c, k), lambda b, s: (0, 0)),
                pl.BlockSpec((c, 1), lambda b, s: (0, 0)),
                rows,
            ],  # fmt: skip
            out_specs=[col, rows],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((bsz, c, 1), _F32),
            jax.ShapeDtypeStruct(state.shape, _F32),
        ],  # fmt: skip
        input_output_aliases={5: 1},  # state (after the scalar-prefetch slots) -> output 1
    )(slots.astype(jnp.int32), keep3, x3, weight.astype(_F32), b2, state)
    return y[:, :, 0], state


def conv_state_update_ref(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    state: jax.Array,
    slots: jax.Array,
    keep: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The jnp reference of `conv_state_update` (functional: returns the new state)."""
    st = state[slots] * keep.astype(_F32)[:, None, None]
    full = jnp.concatenate([st, x.astype(_F32)[:, :, None]], axis=2)  # [B, C, K]
    y = (full * weight.astype(_F32)[None]).sum(-1)
    if bias is not None:
        y = y + bias.astype(_F32)
    return y, state.at[slots].set(full[:, :, 1:])


# --- selective state update, one step ---------------------------------------------------------


def _ssm_kernel(slots_ref, keep_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, h_ref, y_ref,
                ho_ref):  # fmt: skip  # noqa: ANN001, ANN202
    del slots_ref  # used by the index maps only
    st = h_ref[0, 0] * keep_ref[0, 0]  # [P, N]
    x = x_ref[0, 0]  # [P, 1]
    dt = dt_ref[0, 0]  # [1, 1]
    a, bv, cv = a_ref[0], b_ref[0, 0], c_ref[0, 0]  # [1, N] each
    st = jnp.exp(dt * a) * st + (dt * x) * bv
    ho_ref[0, 0] = st
    y_ref[0, 0] = jnp.sum(st * cv, axis=1, keepdims=True) + d_ref[0] * x


def _check_ssm(state: jax.Array, x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array,
               C: jax.Array, D: jax.Array | None, slots: jax.Array, keep: jax.Array) -> None:  # fmt: skip
    bsz, hs, p = x.shape
    if state.dtype != _F32 or state.ndim != 4 or state.shape[1:3] != (hs, p):
        raise ValueError(
            f"ssm_state_update: state must be float32 [S, {hs}, {p}, N], "
            f"got {state.dtype} {tuple(state.shape)}"
        )
    n, g = state.shape[3], B.shape[1]
    if B.shape != (bsz, g, n) or C.shape != (bsz, g, n) or g == 0 or hs % g:
        raise ValueError(f"ssm_state_update: B / C must be [{bsz}, G, {n}] with G dividing {hs}")
    if A.shape not in ((hs,), (hs, n)):
        raise ValueError(f"ssm_state_update: A must be [{hs}] or [{hs}, {n}], got {A.shape}")
    if dt.shape != (bsz, hs) or slots.shape != (bsz,) or keep.shape != (bsz,):
        raise ValueError("ssm_state_update: dt [B, Hs], slots [B] and keep [B] expected")
    if D is not None and D.shape != (hs,):
        raise ValueError(f"ssm_state_update: D must be [{hs}], got {D.shape}")


def ssm_state_update(
    state: jax.Array,
    slots: jax.Array,
    keep: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """state [S, Hs, P, N] float32, slots [B] int32 (distinct, < S), keep [B] float32,
    x [B, Hs, P], dt [B, Hs] (dt_bias added, softplus'd), A [Hs, N] or [Hs], B / C [B, G, N],
    D [Hs] | None -> (y [B, Hs, P] float32, the updated state; the input state buffer is reused
    in place)."""
    _check_ssm(state, x, dt, A, B, C, D, slots, keep)
    bsz, hs, p = x.shape
    n, g = state.shape[3], B.shape[1]
    per_group = hs // g
    a3 = jnp.broadcast_to(A.astype(_F32).reshape(hs, -1), (hs, n))[:, None, :]  # [Hs, 1, N]
    d3 = (jnp.zeros((hs,), _F32) if D is None else D.astype(_F32))[:, None, None]
    x4 = x.astype(_F32)[..., None]  # [B, Hs, P, 1]
    dt4 = dt.astype(_F32)[:, :, None, None]
    b4, c4 = (v.astype(_F32)[:, :, None, :] for v in (B, C))  # [B, G, 1, N]
    keep4 = keep.astype(_F32)[:, None, None, None]
    head = lambda r, c: pl.BlockSpec((1, 1, r, c), lambda b, i, s: (b, i, 0, 0))  # noqa: E731
    group = pl.BlockSpec((1, 1, 1, n), lambda b, i, s: (b, i // per_group, 0, 0))
    rows = pl.BlockSpec((1, 1, p, n), lambda b, i, s: (s[b], i, 0, 0))
    y, state = pl.pallas_call(
        _ssm_kernel,
        grid_spec=PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(bsz, hs),
            in_specs=[
                pl.BlockSpec((1, 1, 1, 1), lambda b, i, s: (b, 0, 0, 0)),
                head(p, 1),
                head(1, 1),
                pl.BlockSpec((1, 1, n), lambda b, i, s: (i, 0, 0)),
                group,
                group,
                pl.BlockSpec((1, 1, 1), lambda b, i, s: (i, 0, 0)),
                rows,
            ],  # fmt: skip
            out_specs=[head(p, 1), rows],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((bsz, hs, p, 1), _F32),
            jax.ShapeDtypeStruct(state.shape, _F32),
        ],  # fmt: skip
        input_output_aliases={8: 1},  # state (after the scalar-prefetch slots) -> output 1
    )(slots.astype(jnp.int32), keep4, x4, dt4, a3, b4, c4, d3, state)
    return y[..., 0], state


def ssm_state_update_ref(
    state: jax.Array,
    slots: jax.Array,
    keep: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """The jnp reference of `ssm_state_update` (functional: returns the new state)."""
    _check_ssm(state, x, dt, A, B, C, D, slots, keep)
    hs, g, n = x.shape[1], B.shape[1], state.shape[3]
    bh = jnp.repeat(B.astype(_F32), hs // g, axis=1)  # [B, Hs, N]
    ch = jnp.repeat(C.astype(_F32), hs // g, axis=1)
    a = jnp.broadcast_to(A.astype(_F32).reshape(hs, -1), (hs, n))
    xf = x.astype(_F32)
    h = state[slots] * keep.astype(_F32)[:, None, None, None]
    d = dt.astype(_F32)[:, :, None, None]
    h = jnp.exp(d * a[None, :, None, :]) * h + (d * xf[..., None]) * bh[:, :, None, :]
    y = (h * ch[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + D.astype(_F32)[None, :, None] * xf
    return y, state.at[slots].set(h)


# --- prefill: causal conv1d over one request's tokens -------------------------------------------


def _conv_prefill_kernel(n_ref, x_ref, w_ref, b_ref, st_ref, y_ref, so_ref, *, k: int, t: int):  # noqa: ANN001, ANN202
    # C on lanes: x [T, BC], state [K-1, BC] (the oldest input first), weight [K, BC].
    xp = jnp.concatenate([st_ref[...], x_ref[...]], axis=0)  # [K-1+T, BC]: (state, x)
    w = w_ref[...]
    acc = xp[0:t] * w[0:1]
    for j in range(1, k):  # tap j reads input t - (K-1) + j = xp[t + j]
        acc = acc + xp[j : j + t] * w[j : j + 1]
    y_ref[...] = acc + b_ref[...]
    # The new state: the last K-1 inputs of (state, x[:n]) = xp[n : n + K-1].
    so_ref[...] = jax.lax.dynamic_slice_in_dim(xp, n_ref[0], k - 1, axis=0)


def causal_conv1d_prefill(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    state: jax.Array,
    length: jax.Array | int | None = None,
    block_c: int = 128,
) -> tuple[jax.Array, jax.Array]:
    """One request's prefill through the causal depthwise conv: x [T, C], weight [C, K] (K >= 2),
    bias [C] | None, state [C, K-1] (the K-1 inputs before x, oldest first) -> (y [T, C] float32
    before the activation, new state [C, K-1] float32 = the last K-1 inputs of (state,
    x[:length])). length (a traced int32 scalar is fine; default T): the real tokens of a padded
    x; rows past it give garbage y and never enter the state. Grid: C blocks of block_c lanes (the
    whole C when it does not divide). The twin of kernels_cuda.ssm_prefill.causal_conv1d_prefill."""
    t, c = x.shape
    k = weight.shape[1]
    if k < 2 or weight.shape[0] != c or state.shape != (c, k - 1):
        raise ValueError(
            f"causal_conv1d_prefill: x [T, C], weight [C, K >= 2], state [C, K-1]; got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(state.shape)}"
        )
    bc = block_c if c % block_c == 0 else c
    n = jnp.asarray(t if length is None else length, jnp.int32).reshape(1)
    b2 = jnp.zeros((1, c), _F32) if bias is None else bias.astype(_F32).reshape(1, c)
    lanes = lambda rows: pl.BlockSpec((rows, bc), lambda i, n: (0, i))  # noqa: E731
    y, new = pl.pallas_call(
        lambda *refs: _conv_prefill_kernel(*refs, k=k, t=t),
        grid_spec=PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(c // bc,),
            in_specs=[lanes(t), lanes(k), lanes(1), lanes(k - 1)],
            out_specs=[lanes(t), lanes(k - 1)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((t, c), _F32),
            jax.ShapeDtypeStruct((k - 1, c), _F32),
        ],  # fmt: skip
    )(n, x.astype(_F32), weight.astype(_F32).T, b2, state.astype(_F32).T)
    return y, new.T


def causal_conv1d_prefill_ref(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    state: jax.Array,
    length: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The jnp reference of `causal_conv1d_prefill`: the model's ragged conv
    (models_flax.ssm_ops.ragged_causal_conv1d) with one request row."""
    from xlaserve.models_flax.ssm_ops import ragged_causal_conv1d, row_layout

    t = x.shape[0]
    n = t if length is None else length
    cu = jnp.asarray([0, n], jnp.int32)
    lay = row_layout(cu, jnp.asarray([n + 1], jnp.int32), t)  # not fresh: the state counts
    y, new = ragged_causal_conv1d(x, weight, bias, state.astype(_F32)[None], lay, cu)
    return y, new[0]


# --- prefill: Mamba2 chunked SSD scan over one request's tokens ---------------------------------


def _tri(n: int) -> jax.Array:
    """[n, n] float32 lower-triangular ones (diagonal included)."""
    r = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return jnp.where(r >= c, 1.0, 0.0).astype(_F32)


def _mm(a: jax.Array, b: jax.Array, dims: tuple) -> jax.Array:
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=_F32,
                               precision=jax.lax.Precision.HIGHEST)  # fmt: skip


def _ssd_prefill_kernel(x_ref, dc_ref, dr_ref, a_ref, b_ref, c_ref, d_ref, h0_ref, y_ref, h_ref,
                        *, bt: int, n: int):  # fmt: skip  # noqa: ANN001, ANN202
    lower = _tri(bt)
    a = a_ref[0]  # [1, 1]
    dd = d_ref[0]  # [1, 1]

    def body(ci, h):  # noqa: ANN001, ANN202
        rows = pl.ds(pl.multiple_of(ci * bt, bt), bt)
        x = x_ref[0, rows, :]  # [L, P]
        dtc, dtr = dc_ref[0, rows, :], dr_ref[0, :, rows]  # [L, 1], [1, L]
        bb, cc = b_ref[0, rows, :], c_ref[0, rows, :]  # [L, N]
        la_c = _mm(lower, dtc * a, ((1,), (0,)))  # [L, 1] log decay from the chunk start
        la_r = _mm(dtr * a, lower, ((1,), (1,)))  # [1, L] the same as a row
        decay = jnp.exp(jnp.minimum(la_c - la_r, 0.0)) * lower  # exp(la_i - la_j), j <= i
        w = _mm(cc, bb, ((1,), (1,))) * decay * dtr  # (C B^T) masked, times dt_j
        y = _mm(w, x, ((1,), (0,))) + jnp.exp(la_c) * _mm(cc, h, ((1,), (1,)))  # + carried h
        y_ref[0, rows, :] = y + dd * x
        la_end = la_c[bt - 1 : bt, :]  # [1, 1]
        xw = x * (jnp.exp(la_end - la_c) * dtc)  # [L, P]
        return jnp.exp(la_end) * h + _mm(xw, bb, ((0,), (0,)))  # [P, N]

    h_ref[0] = jax.lax.fori_loop(0, n, body, h0_ref[0].astype(_F32))


def ssd_chunked_prefill(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array | None,
    h0: jax.Array,
    chunk: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """One request's Mamba2 prefill: x [T, Hs, P], dt [T, Hs] (softplus'ed; 0 on padding tokens,
    which then change nothing), A [Hs] (any shape of Hs scalars), B / C [T, G, N] (head h reads
    group h // (Hs / G)), D [Hs] | None, h0 [Hs, P, N] -> (y [T, Hs, P] float32, h_T [Hs, P, N]
    float32). One program per head walks the chunks of `chunk` tokens (T padded with dt = 0):
    inside a chunk y = ((C B^T) * decay * dt) x + exp(la) (C h^T) + D x, then h carried to the
    chunk end. The twin of kernels_cuda.ssm_prefill.ssd_chunked_prefill (same maths)."""
    t, hs, p = x.shape
    g, nst = B.shape[1], B.shape[2]
    if dt.shape != (t, hs) or A.size != hs or B.shape[0] != t or C.shape != B.shape:
        raise ValueError("ssd_chunked_prefill: dt [T, Hs], A of Hs scalars, B = C [T, G, N]")
    if g < 1 or hs % g or h0.shape != (hs, p, nst):
        raise ValueError(f"ssd_chunked_prefill: G must divide Hs and h0 be [Hs, P, N]; got G={g}")
    if chunk < 8 or chunk % 8:
        raise ValueError(f"ssd_chunked_prefill: chunk must be a multiple of 8, got {chunk}")
    pad = (-t) % chunk
    tp = t + pad
    rep = hs // g

    def hm(a: jax.Array) -> jax.Array:  # [T, H, ...] -> [H, Tp, ...] float32, zero padded
        a = jnp.pad(a.astype(_F32), [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return jnp.moveaxis(a, 1, 0)

    dtc = hm(dt)[..., None]  # [Hs, Tp, 1]
    d3 = (jnp.zeros(hs, _F32) if D is None else D.astype(_F32).reshape(hs)).reshape(hs, 1, 1)
    per_head = lambda d: pl.BlockSpec((1, tp, d), lambda i: (i, 0, 0))  # noqa: E731
    per_group = pl.BlockSpec((1, tp, nst), lambda i: (i // rep, 0, 0))
    scalar = pl.BlockSpec((1, 1, 1), lambda i: (i, 0, 0))
    state = pl.BlockSpec((1, p, nst), lambda i: (i, 0, 0))
    y, h = pl.pallas_call(
        lambda *refs: _ssd_prefill_kernel(*refs, bt=chunk, n=tp // chunk),
        grid=(hs,),
        in_specs=[
            per_head(p), per_head(1), pl.BlockSpec((1, 1, tp), lambda i: (i, 0, 0)), scalar,
            per_group, per_group, scalar, state,
        ],  # fmt: skip
        out_specs=[per_head(p), state],
        out_shape=[
            jax.ShapeDtypeStruct((hs, tp, p), _F32),
            jax.ShapeDtypeStruct((hs, p, nst), _F32),
        ],  # fmt: skip
    )(hm(x), dtc, jnp.swapaxes(dtc, 1, 2), A.astype(_F32).reshape(hs, 1, 1), hm(B), hm(C), d3,
      h0.astype(_F32))  # fmt: skip
    return jnp.moveaxis(y, 0, 1)[:t], h


def ssd_chunked_prefill_ref(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array | None,
    h0: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The jnp reference of `ssd_chunked_prefill`: the model's sequential recurrence
    (models_flax.ssm_ops.ragged_selective_scan) with one request row, groups expanded."""
    from xlaserve.models_flax.ssm_ops import ragged_selective_scan, row_layout

    t, hs = dt.shape
    rep = hs // B.shape[1]
    cu = jnp.asarray([0, t], jnp.int32)
    lay = row_layout(cu, jnp.asarray([t + 1], jnp.int32), t)
    bh, ch = jnp.repeat(B, rep, axis=1), jnp.repeat(C, rep, axis=1)
    y, h = ragged_selective_scan(
        x, dt, A.astype(_F32).reshape(hs, 1, 1), bh, ch, D, h0.astype(_F32)[None], lay, cu
    )
    return y, h[0]
