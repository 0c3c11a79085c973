"""Pallas TPU quantized matmuls (TPU interpret mode on CPU) vs the jnp references, and
`quant_linear` (the XLA backend's quantized linear) vs the numpy dequantized weight."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from optional_deps import import_or_skip

jax = import_or_skip("jax")
import jax.numpy as jnp  # noqa: E402

from xlaserve.quantization import (  # noqa: E402
    dequantize_int4,
    dequantize_int8,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)


@pytest.fixture
def interpret() -> Iterator[None]:
    from xlaserve.kernels_pallas import compat

    try:
        with compat.tpu_interpret_mode():
            yield
    finally:
        compat.reset_interpret_state()


def test_int4_pallas_by_hand(interpret: None) -> None:
    from xlaserve.kernels_pallas.quant_matmul import int4_matmul_pallas
    from xlaserve.quantization import pack_int4

    q = (np.arange(32) % 16).astype(np.uint8)[None, :]
    packed = jnp.asarray(pack_int4(q, 16))
    s = jnp.asarray([[1.0, 0.5]], jnp.float32)
    z = jnp.asarray([[8, 0]], jnp.uint8)
    x = np.zeros((1, 32), np.float32)
    x[0, 5], x[0, 25] = 1.0, 2.0  # (5 - 8) * 1 + (9 - 0) * 0.5 * 2
    y = int4_matmul_pallas(jnp.asarray(x), packed, s, z, blocks=(8, 128))
    assert np.asarray(y).tolist() == [[6.0]]


@pytest.mark.parametrize("m,n,k", [(3, 192, 256), (9, 130, 200)])
def test_int8_pallas_vs_ref(interpret: None, m: int, n: int, k: int) -> None:
    from xlaserve.kernels_pallas.quant_matmul import int8_matmul_pallas, int8_matmul_ref

    rng = np.random.default_rng(m)
    q, s = quantize_int8(rng.normal(size=(n, k)).astype(np.float32))
    x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32))
    y = int8_matmul_pallas(x, jnp.asarray(q), jnp.asarray(s), blocks=(8, 128, 128))
    ref = int8_matmul_ref(x, jnp.asarray(q), jnp.asarray(s))
    assert y.shape == (m, n)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_int4_pallas_vs_ref(interpret: None, dtype: jnp.dtype, tol: float) -> None:
    from xlaserve.kernels_pallas.quant_matmul import int4_matmul_pallas, int4_matmul_ref

    rng = np.random.default_rng(1)
    p, s, z = quantize_int4(rng.normal(size=(136, 256)).astype(np.float32), 128)
    x = jnp.asarray(rng.normal(size=(5, 256)).astype(np.float32)).astype(dtype)
    args = (jnp.asarray(p), jnp.asarray(s), jnp.asarray(z))
    y = np.asarray(int4_matmul_pallas(x, *args, blocks=(8, 128))).astype(np.float32)
    ref = np.asarray(int4_matmul_ref(x, *args)).astype(np.float32)
    assert np.abs(y - ref).max() <= tol * np.abs(ref).max()


def test_quant_linear_reference_path() -> None:
    """jnp path (no TPU): int8 / int4 (+ act-order perm and bias) / fp8 vs numpy dequantized."""
    from xlaserve.kernels_pallas.quant_matmul import quant_linear

    rng = np.random.default_rng(2)
    w = rng.normal(size=(24, 64)).astype(np.float32)
    x = rng.normal(size=(2, 3, 64)).astype(np.float32)
    bias = rng.normal(size=24).astype(np.float32)
    q, s = quantize_int8(w)
    y = quant_linear(jnp.asarray(x), {"qweight": q, "scales": s, "bias": bias}, "int8")
    np.testing.assert_allclose(
        np.asarray(y), x @ dequantize_int8(q, s).T + bias, rtol=1e-5, atol=1e-4
    )
    perm = rng.permutation(64).astype(np.int32)
    p, s4, z = quantize_int4(w[:, perm], 32)
    params = {"qweight": p, "scales": s4, "qzeros": z, "perm": perm}
    y = quant_linear(jnp.asarray(x), params, "int4")
    np.testing.assert_allclose(
        np.asarray(y), x[..., perm] @ dequantize_int4(p, s4, z).T, rtol=1e-5, atol=1e-4
    )
    q8, s8 = quantize_fp8(w)
    y = quant_linear(jnp.asarray(x), {"qweight": jnp.asarray(q8), "scales": s8}, "fp8")
    np.testing.assert_allclose(
        np.asarray(y), x @ (q8.astype(np.float32) * s8[:, None]).T, atol=1e-4
    )
    with pytest.raises(ValueError, match="does not fit"):
        quant_linear(jnp.asarray(x[..., :32]), {"qweight": q, "scales": s}, "int8")
