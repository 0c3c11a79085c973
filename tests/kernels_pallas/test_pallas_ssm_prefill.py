"""State-space PREFILL Pallas kernels (kernels_pallas/ssm.py: causal_conv1d_prefill,
ssd_chunked_prefill) in TPU interpret mode on the CPU, against their jnp references (the Flax
model's ragged ops with one request row) and the Triton twins' torch references: ragged lengths
(T = 1, T < K-1, T not a multiple of the chunk), padding past a real length, groups, D None,
nonzero initial states, and chunk carry (two calls carrying the state == one call)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _close(a: object, b: object, tol: float = 2e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _conv_inputs(t: int, c: int, k: int, seed: int) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    f = np.float32
    return tuple(
        jnp.asarray(rng.normal(size=s).astype(f)) for s in ((t, c), (c, k), (c,), (c, k - 1))
    )


@pytest.mark.parametrize(
    ("t", "c", "k", "with_bias"),
    [(13, 256, 4, True), (1, 40, 4, False), (2, 24, 4, True), (9, 8, 2, True)],
)
def test_conv_prefill_matches_references(t, c, k, with_bias, tpu_interpret) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import ssm

    x, w, b, st = _conv_inputs(t, c, k, seed=t + c)
    bias = b if with_bias else None
    y, new = ssm.causal_conv1d_prefill(x, w, bias, st)
    want_y, want_new = ssm.causal_conv1d_prefill_ref(x, w, bias, st)
    assert y.shape == (t, c) and new.shape == (c, k - 1) and y.dtype == jnp.float32
    _close(y, want_y)
    _close(new, want_new)
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from xlaserve.kernels_cuda.ssm_prefill import causal_conv1d_prefill_ref as torch_ref

    ty, tnew = torch_ref(*(torch.from_numpy(np.asarray(a)) for a in (x, w)),
                         None if bias is None else torch.from_numpy(np.asarray(bias)),
                         torch.from_numpy(np.asarray(st)))  # fmt: skip
    _close(y, ty.numpy())
    _close(new, tnew.numpy())


def test_conv_prefill_padding_never_enters_the_state(tpu_interpret) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import ssm

    x, w, b, st = _conv_inputs(16, 128, 4, seed=3)
    for n in (1, 2, 11):  # < K-1 and longer; traced lengths as a bucketed program passes them
        y, new = jax.jit(ssm.causal_conv1d_prefill)(x, w, b, st, jnp.int32(n))
        want_y, want_new = ssm.causal_conv1d_prefill_ref(x[:n], w, b, st)
        _close(y[:n], want_y)
        _close(new, want_new)


def test_conv_prefill_chunks_carry_the_state(tpu_interpret) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import ssm

    x, w, b, st = _conv_inputs(11, 32, 4, seed=5)
    y1, s1 = ssm.causal_conv1d_prefill(x[:2], w, b, st)  # first chunk shorter than K-1
    y2, s2 = ssm.causal_conv1d_prefill(x[2:], w, b, s1)
    y, s = ssm.causal_conv1d_prefill(x, w, b, st)
    _close(jnp.concatenate([y1, y2]), y)
    _close(s2, s)


def _ssd_inputs(t: int, hs: int, p: int, n: int, g: int, seed: int) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    f = np.float32
    x = rng.normal(size=(t, hs, p)).astype(f)
    dt = np.log1p(np.exp(rng.normal(size=(t, hs)) - 2)).astype(f)  # softplus
    a = -np.exp(rng.normal(size=(hs,))).astype(f)
    b = rng.normal(size=(t, g, n)).astype(f)
    c = rng.normal(size=(t, g, n)).astype(f)
    d = rng.normal(size=(hs,)).astype(f)
    h0 = rng.normal(size=(hs, p, n)).astype(f)
    return tuple(jnp.asarray(v) for v in (x, dt, a, b, c, d, h0))


@pytest.mark.parametrize(
    ("t", "g", "with_d", "chunk"),
    [(37, 2, True, 16), (1, 1, False, 8), (16, 4, True, 16), (20, 1, True, 8)],
)
def test_ssd_prefill_matches_references(t, g, with_d, chunk, tpu_interpret) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import ssm

    x, dt, a, b, c, d, h0 = _ssd_inputs(t, 4, 8, 16, g, seed=t + g)
    dd = d if with_d else None
    y, h = ssm.ssd_chunked_prefill(x, dt, a, b, c, dd, h0, chunk=chunk)
    want_y, want_h = ssm.ssd_chunked_prefill_ref(x, dt, a, b, c, dd, h0)
    assert y.shape == x.shape and h.shape == h0.shape
    _close(y, want_y, 1e-4)
    _close(h, want_h, 1e-4)
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from xlaserve.kernels_cuda.ssm_prefill import ssd_chunked_prefill_ref as torch_ref

    tt = [torch.from_numpy(np.asarray(v)) for v in (x, dt, a, b, c)]
    ty, th = torch_ref(*tt, None if dd is None else torch.from_numpy(np.asarray(dd)),
                       torch.from_numpy(np.asarray(h0)), chunk=chunk)  # fmt: skip
    _close(y, ty.numpy(), 1e-4)
    _close(h, th.numpy(), 1e-4)


def test_ssd_prefill_chunks_carry_the_state(tpu_interpret) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import ssm

    x, dt, a, b, c, d, h0 = _ssd_inputs(29, 4, 8, 16, 2, seed=9)
    y1, h1 = ssm.ssd_chunked_prefill(x[:11], dt[:11], a, b[:11], c[:11], d, h0, chunk=8)
    y2, h2 = ssm.ssd_chunked_prefill(x[11:], dt[11:], a, b[11:], c[11:], d, h1, chunk=8)
    y, h = ssm.ssd_chunked_prefill(x, dt, a, b, c, d, h0, chunk=8)
    _close(jnp.concatenate([y1, y2]), y, 1e-4)
    _close(h2, h, 1e-4)


def test_ssd_prefill_zero_dt_padding_changes_nothing(tpu_interpret) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import ssm

    x, dt, a, b, c, d, h0 = _ssd_inputs(12, 4, 8, 16, 1, seed=11)
    dt_pad = dt.at[7:].set(0.0)  # a bucketed program's padding tokens
    _, h_pad = ssm.ssd_chunked_prefill(x, dt_pad, a, b, c, d, h0, chunk=8)
    _, h_real = ssm.ssd_chunked_prefill(x[:7], dt[:7], a, b[:7], c[:7], d, h0, chunk=8)
    _close(h_pad, h_real, 1e-4)
