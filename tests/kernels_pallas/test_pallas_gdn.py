"""Gated delta rule Pallas kernels (kernels_pallas/gdn.py) in TPU interpret mode on the CPU,
against the jnp sequential recurrence (models_flax/gdn_ops.py): the chunked prefill (several chunks
+ a partial one, a prefill split into pieces carrying the state exactly) and the in-place decode
step (fresh and continuing requests, untouched slots)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _inputs(
    t: int, h: int, dk: int, dv: int, seed: int, hard: bool = False
) -> tuple[jax.Array, ...]:
    """hard: slow decay, strong writes and correlated keys, so that every term of the in-chunk
    triangular inverse matters (a truncated inverse fails)."""
    from xlaserve.models_flax.gdn_ops import l2norm

    rng = np.random.default_rng(seed)
    q = l2norm(jnp.asarray(rng.normal(size=(t, h, dk)), jnp.float32)) * dk**-0.5
    kr = rng.normal(size=(t, h, dk)) + (3.0 * rng.normal(size=(1, h, dk)) if hard else 0.0)
    k = l2norm(jnp.asarray(kr, jnp.float32))
    v = jnp.asarray(rng.normal(size=(t, h, dv)), jnp.float32)
    g = -jax.nn.softplus(jnp.asarray(rng.normal(size=(t, h)), jnp.float32))
    beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(t, h)), jnp.float32))
    if hard:
        g, beta = 0.02 * g, 0.5 + 0.5 * beta
    h0 = jnp.asarray(rng.normal(size=(h, dk, dv)), jnp.float32)
    return q, k, v, g, beta, h0


def _close(a: jax.Array, b: jax.Array, tol: float = 1e-4) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("t", "h", "dk", "dv", "hard"),
    [(37, 2, 16, 8, False), (8, 1, 8, 16, False), (35, 2, 8, 8, True)],
)
def test_chunked_prefill_matches_recurrence(
    t: int, h: int, dk: int, dv: int, hard: bool, tpu_interpret
) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import gdn
    from xlaserve.models_flax import gdn_ops

    args = _inputs(t, h, dk, dv, seed=t, hard=hard)
    want_y, want_h = gdn_ops.gated_delta_rule(*args)
    y, ht = gdn.gdn_chunked_prefill(*args, chunk=16)
    _close(y, want_y)
    _close(ht, want_h)


def test_chunked_prefill_carries_state(tpu_interpret) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import gdn
    from xlaserve.models_flax import gdn_ops

    q, k, v, g, beta, h0 = _inputs(40, 2, 8, 8, seed=3)
    want_y, want_h = gdn_ops.gated_delta_rule(q, k, v, g, beta, h0)
    ys, hs = [], h0
    for lo, hi in [(0, 7), (7, 8), (8, 40)]:
        y, hs = gdn.gdn_chunked_prefill(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], hs)
        ys.append(y)
    _close(jnp.concatenate(ys), want_y)
    _close(hs, want_h)


def test_decode_update_in_place(tpu_interpret) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import gdn
    from xlaserve.models_flax import gdn_ops

    S, B, H, dk, dv = 5, 3, 2, 8, 16
    q, k, v, g, beta, _ = _inputs(B, H, dk, dv, seed=9)
    cache = jnp.asarray(np.random.default_rng(1).normal(size=(S, H, dk, dv)), jnp.float32)
    slots = jnp.asarray([4, 0, 2], jnp.int32)
    keep = jnp.asarray([1.0, 0.0, 1.0], jnp.float32)
    y, new = gdn.gdn_decode_update(cache, slots, keep, q, k, v, g, beta)
    for b in range(B):
        h0 = cache[int(slots[b])] * keep[b]
        yr, hr = gdn_ops.gated_delta_rule(q[b : b + 1], k[b : b + 1], v[b : b + 1],
                                          g[b : b + 1], beta[b : b + 1], h0)  # fmt: skip
        _close(y[b], yr[0], 1e-5)
        _close(new[int(slots[b])], hr, 1e-5)
    for s in (1, 3):  # no request's slot: untouched
        np.testing.assert_array_equal(np.asarray(new[s]), np.asarray(cache[s]))
