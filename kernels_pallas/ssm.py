"""Decode-step kernels of state-space layers (Mamba, Mamba2) in Pallas (TPU; tested in TPU
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
