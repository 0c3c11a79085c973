"""State-space decode Pallas kernels (kernels_pallas/ssm.py) in TPU interpret mode on the CPU,
against their jnp references and the Triton twins' torch references (kernels_cuda/ssm.py, plain
torch on the CPU): outputs and the in-place slot caches, fresh (keep = 0) and continuing requests,
slots out of order, untouched slots bit-identical, bias / D None, Mamba2 (scalar A per head,
groups) and Mamba1 (P = 1 style, A [Hs, N]) shapes, non-power-of-two sizes."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

S = 6
SLOTS = [4, 0, 2]  # out of order; slots 1, 3, 5 belong to no request
KEEP = [1.0, 0.0, 1.0]  # the middle request is fresh
UNTOUCHED = (1, 3, 5)


def _close(a: object, b: object, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _torch_ssm():  # noqa: ANN202
    """kernels_cuda.ssm for its torch references (imports triton; refs themselves are torch)."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from xlaserve.kernels_cuda import ssm

    return ssm


def _conv_inputs(c: int, k: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    f = np.float32
    x = rng.normal(size=(3, c)).astype(f)
    w = rng.normal(size=(c, k)).astype(f)
    b = rng.normal(size=(c,)).astype(f)
    state = rng.normal(size=(S, c, k - 1)).astype(f)
    return x, w, b, state


@pytest.mark.parametrize(("c", "k", "with_bias"), [(24, 4, True), (37, 3, False), (8, 2, True)])
def test_conv_state_update_matches_references(
    c: int, k: int, with_bias: bool, tpu_interpret
) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import ssm

    x, w, b, state = _conv_inputs(c, k, seed=c)
    bias = b if with_bias else None
    slots, keep = jnp.asarray(SLOTS, jnp.int32), jnp.asarray(KEEP, jnp.float32)
    args = (jnp.asarray(x), jnp.asarray(w), None if bias is None else jnp.asarray(bias))
    want_y, want_state = ssm.conv_state_update_ref(*args, jnp.asarray(state), slots, keep)
    y, new = ssm.conv_state_update(*args, jnp.asarray(state), slots, keep)
    assert y.shape == (3, c) and y.dtype == jnp.float32
    _close(y, want_y)
    _close(new, want_state)
    for s in UNTOUCHED:
        np.testing.assert_array_equal(np.asarray(new[s]), state[s])
    # The fresh request: its window is (0, ..., 0, x), so y = w[:, -1] * x (+ bias).
    fresh = x[1] * w[:, -1] + (0.0 if bias is None else bias)
    _close(y[1], fresh)
    np.testing.assert_array_equal(np.asarray(new[0][:, -1]), x[1])
    np.testing.assert_array_equal(np.asarray(new[0][:, :-1]), 0.0)


@pytest.mark.parametrize(("c", "k", "with_bias"), [(24, 4, True), (37, 3, False)])
def test_conv_state_update_matches_triton_twin_reference(
    c: int, k: int, with_bias: bool, tpu_interpret
) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import ssm

    tssm = _torch_ssm()
    import torch

    x, w, b, state = _conv_inputs(c, k, seed=c + 1)
    bias = b if with_bias else None
    t_state = torch.from_numpy(state.copy())
    want = tssm.conv_state_update_ref(
        torch.from_numpy(x), torch.from_numpy(w), None if bias is None else torch.from_numpy(bias),
        t_state, torch.tensor(SLOTS), torch.tensor(KEEP),
    )  # fmt: skip
    y, new = ssm.conv_state_update(
        jnp.asarray(x), jnp.asarray(w), None if bias is None else jnp.asarray(bias),
        jnp.asarray(state), jnp.asarray(SLOTS, jnp.int32), jnp.asarray(KEEP, jnp.float32),
    )  # fmt: skip
    _close(y, want.numpy())
    _close(new, t_state.numpy())


def test_conv_state_update_steps_like_a_causal_conv(tpu_interpret) -> None:  # noqa: ANN001
    """Three steps from a fresh state = a causal conv over the three inputs (zero left pad)."""
    from xlaserve.kernels_pallas import ssm

    c, k, t = 5, 4, 3
    rng = np.random.default_rng(7)
    xs = rng.normal(size=(t, c)).astype(np.float32)
    w = rng.normal(size=(c, k)).astype(np.float32)
    state = jnp.asarray(rng.normal(size=(2, c, k - 1)), jnp.float32)  # slot 1 holds garbage
    ys = []
    for i in range(t):
        y, state = ssm.conv_state_update(
            jnp.asarray(xs[i : i + 1]), jnp.asarray(w), None, state,
            jnp.asarray([1], jnp.int32), jnp.asarray([0.0 if i == 0 else 1.0], jnp.float32),
        )  # fmt: skip
        ys.append(np.asarray(y[0]))
    padded = np.concatenate([np.zeros((k - 1, c), np.float32), xs])
    want = np.stack([(padded[i : i + k].T * w).sum(-1) for i in range(t)])
    _close(np.stack(ys), want)


def test_conv_state_update_rejects_bad_state() -> None:
    from xlaserve.kernels_pallas import ssm

    x, w, b, state = _conv_inputs(8, 4, seed=0)
    with pytest.raises(ValueError, match="float32"):
        ssm.conv_state_update(
            jnp.asarray(x), jnp.asarray(w), None, jnp.asarray(state, jnp.bfloat16),
            jnp.asarray(SLOTS, jnp.int32), jnp.asarray(KEEP, jnp.float32),
        )  # fmt: skip


def _ssm_inputs(
    hs: int, p: int, n: int, g: int, scalar_a: bool, with_d: bool, seed: int
) -> dict[str, np.ndarray | None]:
    rng = np.random.default_rng(seed)
    f = np.float32
    bsz = len(SLOTS)
    a = -np.exp(rng.normal(size=(hs,) if scalar_a else (hs, n)))
    return {
        "state": rng.normal(size=(S, hs, p, n)).astype(f),
        "x": rng.normal(size=(bsz, hs, p)).astype(f),
        "dt": np.log1p(np.exp(rng.normal(size=(bsz, hs)))).astype(f),  # softplus'd
        "A": a.astype(f),
        "B": rng.normal(size=(bsz, g, n)).astype(f),
        "C": rng.normal(size=(bsz, g, n)).astype(f),
        "D": rng.normal(size=(hs,)).astype(f) if with_d else None,
    }


SSM_CASES = [
    # hs, p, n, g, scalar A (Mamba2), D
    (4, 8, 16, 2, True, True),  # Mamba2 with groups
    (4, 6, 5, 1, True, False),  # one group, odd sizes, no D
    (6, 1, 16, 6, False, True),  # Mamba1: P = 1 per channel, A [Hs, N], G = Hs
    (3, 5, 7, 3, False, False),
]


@pytest.mark.parametrize(("hs", "p", "n", "g", "scalar_a", "with_d"), SSM_CASES)
def test_ssm_state_update_matches_references(
    hs: int, p: int, n: int, g: int, scalar_a: bool, with_d: bool, tpu_interpret
) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import ssm

    inp = _ssm_inputs(hs, p, n, g, scalar_a, with_d, seed=hs * 100 + n)
    j = {k: None if v is None else jnp.asarray(v) for k, v in inp.items()}
    slots, keep = jnp.asarray(SLOTS, jnp.int32), jnp.asarray(KEEP, jnp.float32)
    args = (j["x"], j["dt"], j["A"], j["B"], j["C"], j["D"])
    want_y, want_state = ssm.ssm_state_update_ref(j["state"], slots, keep, *args)
    y, new = ssm.ssm_state_update(j["state"], slots, keep, *args)
    assert y.shape == (3, hs, p) and y.dtype == jnp.float32
    _close(y, want_y)
    _close(new, want_state)
    for s in UNTOUCHED:
        np.testing.assert_array_equal(np.asarray(new[s]), inp["state"][s])
    # The fresh request (slot 0): h = dt * x (x) B of its group, whatever the old state held.
    rep = hs // g
    bh = np.repeat(inp["B"][1], rep, axis=0)  # [Hs, N]
    fresh = (inp["dt"][1][:, None, None] * inp["x"][1][:, :, None]) * bh[:, None, :]
    _close(new[0], fresh)


@pytest.mark.parametrize(("hs", "p", "n", "g", "scalar_a", "with_d"), SSM_CASES)
def test_ssm_state_update_matches_triton_twin_reference(
    hs: int, p: int, n: int, g: int, scalar_a: bool, with_d: bool, tpu_interpret
) -> None:  # noqa: ANN001
    from xlaserve.kernels_pallas import ssm

    tssm = _torch_ssm()
    import torch

    inp = _ssm_inputs(hs, p, n, g, scalar_a, with_d, seed=hs * 100 + n + 1)
    a_full = np.broadcast_to(inp["A"].reshape(hs, -1), (hs, n)).copy()  # the twin takes [Hs, N]
    t_state = torch.from_numpy(inp["state"].copy())
    t = {k: None if v is None else torch.from_numpy(v) for k, v in inp.items() if k != "state"}
    want = tssm.ssm_state_update_ref(
        t_state, torch.tensor(SLOTS), torch.tensor(KEEP), t["x"], t["dt"],
        torch.from_numpy(a_full), t["B"], t["C"], t["D"],
    )  # fmt: skip
    j = {k: None if v is None else jnp.asarray(v) for k, v in inp.items()}
    y, new = ssm.ssm_state_update(
        j["state"], jnp.asarray(SLOTS, jnp.int32), jnp.asarray(KEEP, jnp.float32),
        j["x"], j["dt"], j["A"], j["B"], j["C"], j["D"],
    )  # fmt: skip
    _close(y, want.numpy())
    _close(new, t_state.numpy())


def test_ssm_state_update_rejects_bad_groups() -> None:
    from xlaserve.kernels_pallas import ssm

    inp = _ssm_inputs(4, 2, 4, 3, True, True, seed=0)  # 3 groups do not divide 4 heads
    j = {k: None if v is None else jnp.asarray(v) for k, v in inp.items()}
    with pytest.raises(ValueError, match="G dividing"):
        ssm.ssm_state_update(
            j["state"], jnp.asarray(SLOTS, jnp.int32), jnp.asarray(KEEP, jnp.float32),
            j["x"], j["dt"], j["A"], j["B"], j["C"], j["D"],
        )  # fmt: skip


def test_kernels_under_jit_with_donated_state(tpu_interpret) -> None:  # noqa: ANN001
    """Jitted with the state buffers donated (how a decode step would call them): the same
    numbers as the references, two steps in a row (the second continuing the first)."""
    from xlaserve.kernels_pallas import ssm

    c, k = 12, 4
    x, w, b, cstate = _conv_inputs(c, k, seed=5)
    inp = _ssm_inputs(4, 8, 16, 2, True, True, seed=6)
    j = {name: jnp.asarray(v) for name, v in inp.items()}
    slots, keep = jnp.asarray(SLOTS, jnp.int32), jnp.asarray(KEEP, jnp.float32)

    def step(conv, h, keep):  # noqa: ANN001, ANN202
        yc, conv = ssm.conv_state_update(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), conv,
                                         slots, keep)  # fmt: skip
        ys, h = ssm.ssm_state_update(h, slots, keep, j["x"], j["dt"], j["A"], j["B"], j["C"],
                                     j["D"])  # fmt: skip
        return yc, ys, conv, h

    def ref(conv, h, keep):  # noqa: ANN001, ANN202
        yc, conv = ssm.conv_state_update_ref(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b),
                                             conv, slots, keep)  # fmt: skip
        ys, h = ssm.ssm_state_update_ref(h, slots, keep, j["x"], j["dt"], j["A"], j["B"],
                                         j["C"], j["D"])  # fmt: skip
        return yc, ys, conv, h

    fast = jax.jit(step, donate_argnums=(0, 1))
    got_c, got_h = jnp.asarray(cstate), jnp.asarray(inp["state"])
    want_c, want_h = jnp.asarray(cstate), jnp.asarray(inp["state"])
    for kp in (keep, jnp.ones_like(keep)):
        yc, ys, got_c, got_h = fast(got_c, got_h, kp)
        wyc, wys, want_c, want_h = ref(want_c, want_h, kp)
        _close(yc, wyc)
        _close(ys, wys)
        _close(got_c, want_c)
        _close(got_h, want_h)
    for s in UNTOUCHED:
        np.testing.assert_array_equal(np.asarray(got_h[s]), inp["state"][s])
