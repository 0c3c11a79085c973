"""The LoRA segment matmul's Triton path without a GPU: the Pallas -> Triton lowering for CUDA
(run on this CPU host) at Llama-8B shapes, and pip Triton compiling that IR to sm_90 PTX (the
torch backend's Triton; skipped when it cannot read JAX's Triton dialect). On a GPU machine the
`gpu` test runs the kernel itself against the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optional_deps import import_or_skip
from triton_ptx import sm90_ptx

from xlaserve.kernels_pallas.lora import SegmentBlockSizes, segment_matmul_gpu

# (M tokens, K, N, block sizes): the shrink (K = hidden, N = rank 16, split K) and the expand
# (K = rank 16, N = intermediate) of a decode batch over 8 slots.
SHAPES = {
    "shrink": (256, 4096, 16, None),
    "expand": (256, 16, 14336, None),
    "shrink-one-piece": (64, 4096, 16, SegmentBlockSizes(k_splits=1)),
}


def _args(m: int, k: int, n: int) -> tuple:
    x = jnp.zeros((m, k), jnp.bfloat16)
    w = jnp.zeros((8, n, k), jnp.bfloat16)
    return x, w, jnp.full((8,), m // 8, jnp.int32)


@pytest.mark.parametrize("name", list(SHAPES))
def test_segment_kernel_lowers_to_triton(name: str) -> None:
    export = import_or_skip("jax.export")
    m, k, n, bs = SHAPES[name]

    def f(x, w, sizes):  # noqa: ANN001, ANN202
        return segment_matmul_gpu(x, w, sizes, bs, interpret=False)

    exported = export.export(
        jax.jit(f),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*_args(m, k, n))
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("name", ["shrink", "expand"])
def test_segment_kernel_compiles_to_ptx_with_triton(name: str, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    m, k, n, bs = SHAPES[name]
    fn = lambda *a: segment_matmul_gpu(*a, bs, interpret=False)  # noqa: E731
    assert "mma" in sm90_ptx(fn, _args(m, k, n), tmp_path, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 256, 2048])
def test_lora_pallas_gpu_on_the_gpu_matches_reference(t: int) -> None:
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    from xlaserve.kernels_pallas.lora import lora_expand, lora_shrink, make_segments

    rng = np.random.default_rng(t)
    d_in, d_out = 4096, 14336
    x = jnp.asarray(rng.normal(size=(t, d_in)), jnp.bfloat16)
    a = jnp.asarray(rng.normal(0, 0.05, size=(8, 16, d_in)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(0, 0.05, size=(8, d_out, 16)), jnp.bfloat16)
    y = jnp.zeros((t, d_out), jnp.bfloat16)
    seg = make_segments(jnp.asarray(np.arange(t) % 9 - 1, jnp.int32), 8)  # -1 included

    def run(impl: str) -> np.ndarray:
        f = jax.jit(
            lambda x, a, b, y: lora_expand(y, lora_shrink(x, a, seg, impl), b, seg, 0, impl)
        )
        return np.asarray(f(x, a, b, y), np.float32)

    got, want = run("pallas_gpu"), run("reference")
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
