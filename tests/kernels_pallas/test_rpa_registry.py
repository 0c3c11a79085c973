"""The XLA attention-backend contract: ragged paged attention implementations registered by name
(`RPA_IMPLS`, `register_rpa_impl`), chosen by the `impl` string (KernelConfig.rpa_impl), a
quantized cache routed to the reference where an implementation declares no support for it."""

from __future__ import annotations

import dataclasses
import importlib

import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve.kernels_pallas import ragged_paged_attention

# The module (the package attribute of that name is the function).
rpa_mod = importlib.import_module("xlaserve.kernels_pallas.ragged_paged_attention")


def _case(quantized: bool = False) -> tuple:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32)
    k = rng.standard_normal((4, 8, 1, 8)).astype(np.float32)
    v = rng.standard_normal((4, 8, 1, 8)).astype(np.float32)
    meta = (
        jnp.asarray([5, 9], jnp.int32),  # kv_lens
        jnp.asarray([[0, 1], [2, 3]], jnp.int32),  # block tables
        jnp.asarray([0, 1, 3], jnp.int32),  # cu_q_lens
        jnp.asarray([2], jnp.int32),  # num_seqs
    )
    if not quantized:
        return q, jnp.asarray(k), jnp.asarray(v), *meta
    scale = jnp.full((4, 8, 1), 0.05, jnp.float32)
    kq = jnp.asarray(np.clip(np.round(k / 0.05), -127, 127), jnp.int8)
    vq = jnp.asarray(np.clip(np.round(v / 0.05), -127, 127), jnp.int8)
    return q, kq, vq, *meta, scale, scale


@pytest.fixture
def spy_impl(monkeypatch):  # noqa: ANN201, ANN001
    calls: list[bool] = []
    ref = rpa_mod.RPA_IMPLS["reference"]

    def fn(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[7] is not None)  # k_scale given
        return ref.fn(*args, **kw)

    monkeypatch.setattr(rpa_mod, "RPA_IMPLS", dict(rpa_mod.RPA_IMPLS))
    rpa_mod.register_rpa_impl(rpa_mod.RpaImpl("spy", fn, False, None))
    return calls


def test_registered_impl_is_chosen_by_name(spy_impl: list[bool]) -> None:
    args = _case()
    got = ragged_paged_attention(*args, sm_scale=0.3, impl="spy")
    want = ragged_paged_attention(*args, sm_scale=0.3, impl="reference")
    assert spy_impl == [False]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_quantized_cache_goes_to_the_reference_without_support(spy_impl: list[bool]) -> None:
    args = _case(quantized=True)
    got = ragged_paged_attention(*args, sm_scale=0.3, impl="spy")
    assert spy_impl == []  # declared quantized_cache=False: the reference ran instead
    want = ragged_paged_attention(*args, sm_scale=0.3, impl="reference")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unknown_names_and_wrong_tiles_are_refused() -> None:
    args = _case()
    with pytest.raises(ValueError, match="impl must be one of"):
        ragged_paged_attention(*args, sm_scale=0.3, impl="nope")
    with pytest.raises(ValueError, match="pallas_tpu takes BlockSizes"):
        ragged_paged_attention(
            *args, sm_scale=0.3, impl="pallas_tpu", block_sizes=rpa_mod.GpuBlockSizes(16, 1)
        )
    with pytest.raises(ValueError, match="not an implementation name"):
        rpa_mod.register_rpa_impl(dataclasses.replace(rpa_mod.RPA_IMPLS["reference"], name="auto"))
