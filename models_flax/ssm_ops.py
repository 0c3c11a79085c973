"""jnp reference ops of state-space layers over a ragged, padded step (the twins of
backends_torch/layers/ssm_ops.py; same rules, see there).

A step holds R request rows (padded to max_num_seqs) and T tokens (padded to the bucket); row r
owns tokens [cu[r], cu[r+1]) and starts at position kv_lens[r] - q_len[r] (0 = fresh: zero
state). Per layer, the state cache is (conv [S, C, K-1], ssm [S, Hs, P, N]) float32 over S slots;
`state_slots[r]` is row r's slot (S for padding rows: their writes are dropped).

- `row_layout`: each token's row and position in its chunk, each row's fresh flag.
- `gather_states` / `scatter_states`: the rows' states from / to their slots.
- `ragged_causal_conv1d`: conv outputs [T, C] and the rows' new conv states, fully vectorised.
- `ragged_selective_scan`: the sequential recurrence with all rows advancing together, one token
  per iteration, max(q_len) iterations (a decode step is one batched update).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RowLayout(NamedTuple):
    tok_row: jax.Array  # i32 [T]: row of each token (R for padding tokens)
    tok_pos: jax.Array  # i32 [T]: position of the token in its row's chunk
    q_len: jax.Array  # i32 [R]
    fresh: jax.Array  # bool [R]: the chunk starts at position 0


def row_layout(cu: jax.Array, kv_lens: jax.Array, num_tokens: int) -> RowLayout:
    """cu [R+1] (padded with the real token count), kv_lens [R] -> RowLayout."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    r = kv_lens.shape[0]
    tok_row = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    tok_pos = t - cu[jnp.minimum(tok_row, r - 1)]
    q_len = cu[1:] - cu[:-1]
    return RowLayout(tok_row, tok_pos, q_len, (kv_lens - q_len) == 0)


def gather_states(
    conv: jax.Array, ssm: jax.Array, slots: jax.Array, fresh: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Rows' states [R, C, K-1] / [R, Hs, P, N]; zeros for fresh rows."""
    idx = jnp.minimum(slots, conv.shape[0] - 1)
    keep = (~fresh).astype(jnp.float32)
    return conv[idx] * keep[:, None, None], ssm[idx] * keep[:, None, None, None]


def scatter_states(
    conv: jax.Array, ssm: jax.Array, slots: jax.Array, conv_new: jax.Array, ssm_new: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Write the rows' new states to their slots (out-of-range padding slots dropped)."""
    return (
        conv.at[slots].set(conv_new.astype(conv.dtype), mode="drop"),
        ssm.at[slots].set(ssm_new.astype(ssm.dtype), mode="drop"),
    )


def ragged_causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    state: jax.Array,
    lay: RowLayout,
    cu: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """x [T, C], weight [C, K], bias [C] | None, state [R, C, K-1] -> (y [T, C] float32 before
    the activation, new state [R, C, K-1])."""
    t_n, c = x.shape
    k = weight.shape[1]
    r = state.shape[0]
    xf, w = x.astype(jnp.float32), weight.astype(jnp.float32)
    row = jnp.minimum(lay.tok_row, r - 1)
    t = jnp.arange(t_n)
    y = jnp.zeros((t_n, c), jnp.float32)
    for o in range(k):  # o tokens back: from this chunk, else from the row's conv state
        from_x = xf[jnp.maximum(t - o, 0)]
        st_idx = jnp.clip(k - 1 - (o - lay.tok_pos), 0, k - 2)
        from_state = state[row, :, :][jnp.arange(t_n), :, st_idx]  # [T, C]
        val = jnp.where((o <= lay.tok_pos)[:, None], from_x, from_state)
        y = y + val * w[None, :, k - 1 - o]
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None]
    # New state: the last K-1 inputs of [state, chunk] per row.
    q = lay.q_len[:, None] - (k - 1) + jnp.arange(k - 1)[None, :]  # [R, K-1] chunk positions
    from_x = xf[jnp.clip(cu[:-1, None] + q, 0, t_n - 1)]  # [R, K-1, C]
    st = jnp.take_along_axis(state, jnp.clip(k - 1 + q, 0, k - 2)[:, None, :], axis=2)
    new_state = jnp.where((q >= 0)[:, None, :], jnp.swapaxes(from_x, 1, 2), st)
    return y, new_state


def ragged_selective_scan(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array | None,
    h0: jax.Array,
    lay: RowLayout,
    cu: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """x [T, Hs, P], dt [T, Hs], A [Hs, 1, 1|N], B / C [T, Hs|1, N], h0 [R, Hs, P, N]
    -> (y [T, Hs, P] float32, h [R, Hs, P, N]). Rows advance together, one token each per
    iteration, for max(q_len) iterations (a decode step: ONE batched update); padding rows and
    tokens change no state."""
    t_n = x.shape[0]
    xf, dtf = x.astype(jnp.float32), dt.astype(jnp.float32)
    Bf, Cf = B.astype(jnp.float32), C.astype(jnp.float32)
    start = cu[:-1]
    q_len = lay.q_len

    def body(j, carry):  # noqa: ANN001, ANN202
        h, y = carry
        valid = j < q_len  # [R]
        t = jnp.where(valid, start + j, t_n)  # out of range: dropped
        tc = jnp.minimum(t, t_n - 1)
        d = dtf[tc][:, :, None, None]  # [R, Hs, 1, 1]
        h_new = jnp.exp(d * A[None]) * h + (d * xf[tc][..., None]) * Bf[tc][:, :, None, :]
        h = jnp.where(valid[:, None, None, None], h_new, h)
        yt = (h_new * Cf[tc][:, :, None, :]).sum(-1)  # [R, Hs, P]
        return h, y.at[t].set(yt, mode="drop")

    y0 = jnp.zeros(x.shape, jnp.float32)
    h, y = jax.lax.fori_loop(0, jnp.max(q_len), body, (h0.astype(jnp.float32), y0))
    if D is not None:
        y = y + D.astype(jnp.float32)[None, :, None] * xf
    return y, h
