"""jnp reference ops of the gated delta rule (Qwen3-Next Gated DeltaNet; the twins of
backends_torch/layers/gdn_ops.py, same rules, see there).

- `gated_delta_rule` / `gated_delta_rule_chunked`: one request's tokens (sequential definition;
  chunked WY form), the references of kernels_pallas/gdn.py.
- `ragged_gated_delta_rule`: a ragged, padded step (models_flax/ssm_ops.py's RowLayout): all rows
  advance together, one token each per iteration, for max(q_len) iterations (a decode step is ONE
  batched update); padding rows and tokens change no state.
- `ragged_gated_delta_rule_chunked`: the same step, every row advancing one chunk of tokens per
  iteration in the WY form (what the Flax model runs: the state moves once per chunk).
- `gdn_qkv`, `gdn_gates`, `gdn_gated_norm`: the layer's input / output maths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.models_flax.ssm_ops import RowLayout


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _step(h: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, b: jax.Array):  # noqa: ANN202
    """h [..., H, dk, dv], q / k [..., H, dk], v [..., H, dv], g / b [..., H] -> (y, h)."""
    h = h * jnp.exp(g)[..., None, None]
    kv = jnp.einsum("...hk,...hkv->...hv", k, h)
    h = h + k[..., :, None] * ((v - kv) * b[..., None])[..., None, :]
    return jnp.einsum("...hk,...hkv->...hv", q, h), h


def gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, h: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sequential reference: q / k [T, H, dk], v [T, H, dv], g / beta [T, H], h [H, dk, dv]
    -> (y [T, H, dv] float32, h_T float32)."""

    def body(h, xs):  # noqa: ANN001, ANN202
        y, h = _step(h, *xs)
        return h, y

    xs = tuple(a.astype(jnp.float32) for a in (q, k, v, g, beta))
    h, y = jax.lax.scan(body, h.astype(jnp.float32), xs)
    return y, h


def gated_delta_rule_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    h: jax.Array,
    chunk: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """The chunked (WY) form (backends_torch/layers/gdn_ops.gated_delta_rule_chunked); T is
    padded to a multiple of `chunk` with g = beta = 0 rows (they change nothing)."""
    t = q.shape[0]
    pad = (-t) % chunk
    f32 = [jnp.pad(a.astype(jnp.float32), [(0, pad)] + [(0, 0)] * (a.ndim - 1))
           for a in (q, k, v, g, beta)]  # fmt: skip
    n = (t + pad) // chunk
    # [n, H, L, ...] head-major chunks.
    q, k, v = (a.reshape(n, chunk, *a.shape[1:]).transpose(0, 2, 1, 3) for a in f32[:3])
    g, beta = (a.reshape(n, chunk, -1).transpose(0, 2, 1) for a in f32[3:])
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    eye = jnp.eye(chunk, dtype=jnp.float32)

    def body(h, xs):  # noqa: ANN001, ANN202
        qc, kc, vc, gc, bc = xs
        gc = jnp.cumsum(gc, axis=-1)  # [H, L]
        diff = jnp.minimum(gc[:, :, None] - gc[:, None, :], 0.0)
        decay = jnp.where(lower, jnp.exp(diff), 0.0)
        kb = kc * bc[..., None]
        m = jnp.tril(kb @ jnp.swapaxes(kc, -1, -2) * decay, -1) + eye
        solve = jax.scipy.linalg.solve_triangular
        u = solve(m, vc * bc[..., None], lower=True, unit_diagonal=True)
        w = solve(m, kb * jnp.exp(gc)[..., None], lower=True, unit_diagonal=True)
        vn = u - w @ h
        y = (qc * jnp.exp(gc)[..., None]) @ h + (qc @ jnp.swapaxes(kc, -1, -2) * decay) @ vn
        kd = kc * jnp.exp(gc[:, -1:] - gc)[..., None]
        h = jnp.exp(gc[:, -1])[:, None, None] * h + jnp.swapaxes(kd, -1, -2) @ vn
        return h, y

    h, y = jax.lax.scan(body, h.astype(jnp.float32), (q, k, v, g, beta))
    y = y.transpose(0, 2, 1, 3).reshape(n * chunk, *y.shape[1:2], y.shape[-1])[:t]
    return y, h


def ragged_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    h0: jax.Array,
    lay: RowLayout,
    cu: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """q / k [T, H, dk], v [T, H, dv], g / beta [T, H], h0 [R, H, dk, dv] -> (y [T, H, dv]
    float32, h [R, H, dk, dv])."""
    t_n = q.shape[0]
    qf, kf, vf, gf, bf = (a.astype(jnp.float32) for a in (q, k, v, g, beta))
    start = cu[:-1]

    def body(j, carry):  # noqa: ANN001, ANN202
        h, y = carry
        valid = j < lay.q_len  # [R]
        t = jnp.where(valid, start + j, t_n)  # out of range: dropped
        tc = jnp.minimum(t, t_n - 1)
        yt, h_new = _step(h, qf[tc], kf[tc], vf[tc], gf[tc], bf[tc])
        h = jnp.where(valid[:, None, None, None], h_new, h)
        return h, y.at[t].set(yt, mode="drop")

    y0 = jnp.zeros(v.shape, jnp.float32)
    h, y = jax.lax.fori_loop(0, jnp.max(lay.q_len), body, (h0.astype(jnp.float32), y0))
    return y, h


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    """float32 matmul at full precision (no TF32 on GPUs: the state is carried for long)."""
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def ragged_gated_delta_rule_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    h0: jax.Array,
    lay: RowLayout,
    cu: jax.Array,
    chunk: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """`ragged_gated_delta_rule` in the chunked (WY) form: every row takes its next L =
    min(chunk, T) tokens per iteration (gathered to [R, H, L, ...]; past a row's q_len the tokens
    are masked: q = k = g = beta = 0, which change neither outputs nor state), so the state is read
    and written once per L tokens, for ceil(max(q_len) / L) iterations; a decode step (q_len <= 1)
    takes `ragged_gated_delta_rule`'s single update instead."""
    t_n = q.shape[0]
    n_l = max(1, min(chunk, t_n))
    f32 = jnp.float32
    qf, kf, vf, gf, bf = (a.astype(f32) for a in (q, k, v, g, beta))
    start = cu[:-1]
    ar = jnp.arange(n_l)
    lower = jnp.tril(jnp.ones((n_l, n_l), bool))
    eye = jnp.eye(n_l, dtype=f32)
    solve = jax.scipy.linalg.solve_triangular

    def body(c, carry):  # noqa: ANN001, ANN202
        h, y = carry
        pos = c * n_l + ar  # [L]
        valid = pos[None, :] < lay.q_len[:, None]  # [R, L]
        t = jnp.where(valid, start[:, None] + pos[None, :], t_n)  # out of range: dropped
        tc = jnp.minimum(t, t_n - 1)
        m = valid.astype(f32)
        # [R, L, H, ...] -> head-major [R, H, L, ...]
        qc, kc = (jnp.swapaxes(a[tc] * m[..., None, None], 1, 2) for a in (qf, kf))
        vc = jnp.swapaxes(vf[tc], 1, 2)
        gc, bc = (jnp.swapaxes(a[tc] * m[..., None], 1, 2) for a in (gf, bf))  # [R, H, L]
        gcum = jnp.cumsum(gc, axis=-1)
        decay = jnp.where(
            lower, jnp.exp(jnp.minimum(gcum[..., :, None] - gcum[..., None, :], 0.0)), 0.0
        )
        kb = kc * bc[..., None]
        kt = jnp.swapaxes(kc, -1, -2)
        mat = jnp.tril(_mm(kb, kt) * decay, -1) + eye
        u = solve(mat, vc * bc[..., None], lower=True, unit_diagonal=True)
        w = solve(mat, kb * jnp.exp(gcum)[..., None], lower=True, unit_diagonal=True)
        vn = u - _mm(w, h)
        yc = _mm(qc * jnp.exp(gcum)[..., None], h) + _mm(_mm(qc, kt) * decay, vn)
        kd = kc * jnp.exp(gcum[..., -1:] - gcum)[..., None]
        h = jnp.exp(gcum[..., -1])[..., None, None] * h + _mm(jnp.swapaxes(kd, -1, -2), vn)
        return h, y.at[t].set(jnp.swapaxes(yc, 1, 2), mode="drop")

    def chunked(h0: jax.Array) -> tuple[jax.Array, jax.Array]:
        y0 = jnp.zeros(v.shape, f32)
        n_it = (jnp.max(lay.q_len) + n_l - 1) // n_l
        h, y = jax.lax.fori_loop(0, n_it, body, (h0.astype(f32), y0))
        return y, h

    # A decode step (at most one token per row) takes the one-token update: no [R, H, L, L]
    # chunk matrices for a single token.
    return jax.lax.cond(
        jnp.max(lay.q_len) <= 1,
        lambda h0: ragged_gated_delta_rule(q, k, v, g, beta, h0, lay, cu),
        chunked,
        h0.astype(f32),
    )


def gdn_qkv(
    xc: jax.Array, n_k_heads: int, n_heads: int, dk: int, dv: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Activated conv output xc [R, 2 Hk dk + Hv dv] -> q / k [R, Hv, dk] (l2-normalised, q
    scaled by dk^-0.5, k heads repeated), v [R, Hv, dv]; float32."""
    r = xc.shape[0]
    xf = xc.astype(jnp.float32)
    kd = n_k_heads * dk
    q, k, v = xf[:, :kd], xf[:, kd : 2 * kd], xf[:, 2 * kd :]
    q = l2norm(q.reshape(r, n_k_heads, dk)) * dk**-0.5
    k = l2norm(k.reshape(r, n_k_heads, dk))
    rep = n_heads // n_k_heads
    if rep > 1:
        q, k = jnp.repeat(q, rep, axis=1), jnp.repeat(k, rep, axis=1)
    return q, k, v.reshape(r, n_heads, dv)


def gdn_gates(
    b: jax.Array, a: jax.Array, a_log: jax.Array, dt_bias: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), float32 [R, H]."""
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    )
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def gdn_gated_norm(
    y: jax.Array, z: jax.Array, weight: jax.Array, eps: float, dtype: jnp.dtype
) -> jax.Array:
    """RMS over each head's dv of y [R, H, dv], times weight [dv] (in dtype), times silu(z)."""
    yf = y.astype(jnp.float32)
    yn = yf * jax.lax.rsqrt(jnp.mean(yf * yf, axis=-1, keepdims=True) + eps)
    yn = weight * yn.astype(dtype)
    return (yn * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)
