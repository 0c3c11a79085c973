"""Weight-only quantized matmul for TPU (Pallas Mosaic) with jnp references, plus
`quant_linear`: the quantized linear layer the XLA backend calls (independent of models_flax).

Layouts are the canonical ones of `xlaserve.quantization.numpy_quant` (what the checkpoint
stream carries under X.qweight / X.scales / X.qzeros / X.perm):
    int8: qweight int8 [N, K], scales f32 [N]                       y = (x @ q^T) * s
    int4: qweight uint8 [N, K/2] in group half-split order (within each group of g input
          channels, byte j holds channel j (low nibble) and j + g/2 (high nibble)), scales f32
          [N, G], qzeros uint8 [N, G]: W[n, k] = (q - z[n, k//g]) * s[n, k//g]
    fp8:  qweight float8_e4m3fn [N, K], scales f32 [N] (jnp path: upcast; weight-only here)
x: [M, K] (bf16/f32) -> [M, N] in x's dtype; accumulation in f32.

Kernel shape: grid (M/bm, N/bn, K/bk), K innermost ("arbitrary"), an f32 VMEM accumulator. The
int4 kernel takes one group per K step (bk = g) and unpacks it as two contiguous halves, so no
ref reshape or lane interleave is needed (the TPU interpreter lacks Ref.reshape).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from xlaserve.kernels_pallas import compat

# Tuned block sizes as data: (block_m, block_n, block_k_int8). M is padded to block_m.
BLOCKS: dict[str, tuple[int, int, int]] = {
    "decode": (8, 256, 512),  # M <= 8: a decode batch
    "small": (64, 256, 512),
    "prefill": (128, 256, 512),
}


def _blocks(m: int, n: int, k: int) -> tuple[int, int, int]:
    key = "decode" if m <= 8 else ("small" if m <= 64 else "prefill")
    bm, bn, bk = BLOCKS[key]
    bn = min(bn, _round_up(n, 128))
    bk = min(bk, _round_up(k, 128))
    return bm, bn, bk


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] . b [N, K]^T -> [M, N] f32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# ---- references ----------------------------------------------------------------------------------


def unpack_int4_ref(qweight: jax.Array, group: int) -> jax.Array:
    """uint8 [N, K/2] (group half-split) -> int32 [N, K] values 0..15."""
    n, k2 = qweight.shape
    p = qweight.astype(jnp.int32).reshape(n, (2 * k2) // group, group // 2)
    return jnp.stack([p & 0xF, p >> 4], axis=2).reshape(n, 2 * k2)


def dequant_int4_ref(qweight: jax.Array, scales: jax.Array, qzeros: jax.Array) -> jax.Array:
    """-> W f32 [N, K]."""
    n, k2 = qweight.shape
    k = 2 * k2
    g = k // scales.shape[1]
    q = unpack_int4_ref(qweight, g).reshape(n, k // g, g).astype(jnp.float32)
    w = (q - qzeros.astype(jnp.float32)[:, :, None]) * scales.astype(jnp.float32)[:, :, None]
    return w.reshape(n, k)


def int8_matmul_ref(x: jax.Array, qweight: jax.Array, scales: jax.Array) -> jax.Array:
    y = _dot_t(x.astype(jnp.float32), qweight.astype(jnp.float32))
    return (y * scales.astype(jnp.float32)[None, :]).astype(x.dtype)


def int4_matmul_ref(
    x: jax.Array, qweight: jax.Array, scales: jax.Array, qzeros: jax.Array
) -> jax.Array:
    w = dequant_int4_ref(qweight, scales, qzeros)
    return _dot_t(x.astype(jnp.float32), w).astype(x.dtype)


# ---- kernels -------------------------------------------------------------------------------------


def _int8_kernel(x_ref, w_ref, s_ref, o_ref, acc_ref):  # noqa: ANN001, ANN202
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():  # noqa: ANN202
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    w = w_ref[...].astype(x.dtype)  # int8 values are exact in bf16
    acc_ref[...] += _dot_t(x, w)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _done():  # noqa: ANN202
        o_ref[...] = (acc_ref[...] * s_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _int4_kernel(x_ref, w_ref, s_ref, z_ref, o_ref, acc_ref, *, half: int):  # noqa: ANN001, ANN202
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():  # noqa: ANN202
        acc_ref[...] = jnp.zeros_like(acc_ref)

    p = w_ref[...].astype(jnp.int32)  # [bn, g/2]
    z = z_ref[pl.ds(kk, 1), :].astype(jnp.int32).T  # [bn, 1]: this group's zero points
    s = s_ref[pl.ds(kk, 1), :].astype(jnp.float32)  # [1, bn]
    dt = x_ref.dtype
    lo = ((p & 0xF) - z).astype(dt)  # channels [0, g/2) of the group
    hi = ((p >> 4) - z).astype(dt)  # channels [g/2, g)
    part = _dot_t(x_ref[:, :half], lo) + _dot_t(x_ref[:, half:], hi)
    acc_ref[...] += part * s

    @pl.when(kk == pl.num_programs(2) - 1)
    def _done():  # noqa: ANN202
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _pad2(a: jax.Array, r: int, c: int) -> jax.Array:
    pr, pc = r - a.shape[0], c - a.shape[1]
    return a if pr == 0 and pc == 0 else jnp.pad(a, ((0, pr), (0, pc)))


def int8_matmul_pallas(
    x: jax.Array, qweight: jax.Array, scales: jax.Array, blocks: tuple[int, int, int] | None = None
) -> jax.Array:
    """Pallas TPU int8 weight-only matmul; shapes as `int8_matmul_ref`."""
    m, k = x.shape
    n = qweight.shape[0]
    bm, bn, bk = blocks or _blocks(m, n, k)
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
    xp = _pad2(x, mp, kp)
    wp = _pad2(qweight, np_, kp)
    sp = _pad2(scales.astype(jnp.float32)[None, :], 1, np_)
    out = pl.pallas_call(
        _int8_kernel,
        grid=(mp // bm, np_ // bn, kp // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bn, bk), lambda i, j, kk: (j, kk)),
            pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        scratch_shapes=[compat.VMEM((bm, bn), jnp.float32)],
        compiler_params=compat.compiler_params(("parallel", "parallel", "arbitrary")),
        name="xlaserve_int8_matmul",
    )(xp, wp, sp)
    return out[:m, :n]


def int4_matmul_pallas(
    x: jax.Array,
    qweight: jax.Array,
    scales: jax.Array,
    qzeros: jax.Array,
    blocks: tuple[int, int] | None = None,
) -> jax.Array:
    """Pallas TPU int4 group-wise matmul (one group per K step); shapes as `int4_matmul_ref`.
    blocks: (block_m, block_n) override."""
    m, k = x.shape
    n = qweight.shape[0]
    n_groups = scales.shape[1]
    g = k // n_groups
    bm, bn, _ = _blocks(m, n, k)
    if blocks is not None:
        bm, bn = blocks
    mp, np_ = _round_up(m, bm), _round_up(n, bn)
    xp = _pad2(x, mp, k)
    wp = _pad2(qweight, np_, k // 2)
    # [G, N]: a group's scales/zeros are one row, read with a dynamic sublane index.
    st = _pad2(scales.astype(jnp.float32).T, n_groups, np_)
    zt = _pad2(qzeros.astype(jnp.int32).T, n_groups, np_)
    out = pl.pallas_call(
        functools.partial(_int4_kernel, half=g // 2),
        grid=(mp // bm, np_ // bn, n_groups),
        in_specs=[
            pl.BlockSpec((bm, g), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bn, g // 2), lambda i, j, kk: (j, kk)),
            pl.BlockSpec((n_groups, bn), lambda i, j, kk: (0, j)),
            pl.BlockSpec((n_groups, bn), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        scratch_shapes=[compat.VMEM((bm, bn), jnp.float32)],
        compiler_params=compat.compiler_params(("parallel", "parallel", "arbitrary")),
        name="xlaserve_int4_matmul",
    )(xp, wp, st, zt)
    return out[:m, :n]


# ---- public entry points -------------------------------------------------------------------------


def _use_pallas(impl: str) -> bool:
    if impl == "auto":
        return jax.default_backend() == "tpu" or compat.is_interpret_forced()
    if impl not in ("pallas_tpu", "reference"):
        raise ValueError(f"impl must be 'auto', 'pallas_tpu' or 'reference', got {impl!r}")
    return impl == "pallas_tpu"


def _check(x: jax.Array, qweight: jax.Array, method: str) -> None:
    if x.ndim != 2 or qweight.ndim != 2:
        raise ValueError(f"quant matmul: x [M, K] and qweight 2-D, got {x.shape}, {qweight.shape}")
    k = x.shape[1]
    want = k // 2 if method == "int4" else k
    if qweight.shape[1] != want:
        raise ValueError(f"{method}: qweight {qweight.shape} does not fit x {x.shape}")


@functools.partial(jax.jit, static_argnames=("impl",))
def int8_matmul(
    x: jax.Array, qweight: jax.Array, scales: jax.Array, impl: str = "auto"
) -> jax.Array:
    """x [M, K], qweight int8 [N, K], scales [N] -> [M, N] x.dtype."""
    _check(x, qweight, "int8")
    if _use_pallas(impl):
        return int8_matmul_pallas(x, qweight, scales)
    return int8_matmul_ref(x, qweight, scales)


@functools.partial(jax.jit, static_argnames=("impl",))
def int4_matmul(
    x: jax.Array, qweight: jax.Array, scales: jax.Array, qzeros: jax.Array, impl: str = "auto"
) -> jax.Array:
    """x [M, K], qweight uint8 [N, K/2], scales [N, G], qzeros uint8 [N, G] -> [M, N]."""
    _check(x, qweight, "int4")
    if scales.shape != qzeros.shape or x.shape[1] % scales.shape[1]:
        raise ValueError(f"int4: scales {scales.shape} / qzeros {qzeros.shape} must be [N, G]")
    if _use_pallas(impl):
        return int4_matmul_pallas(x, qweight, scales, qzeros)
    return int4_matmul_ref(x, qweight, scales, qzeros)


def quant_linear(
    x: jax.Array, params: dict[str, jax.Array], method: str, impl: str = "auto"
) -> jax.Array:
    """The XLA backend's quantized linear. x [..., K] -> [..., N].

    params: the layer's canonical tensors without the prefix: {"qweight", "scales"[, "qzeros"]
    [, "perm"][, "bias"]} (see the module docstring; "perm" = GPTQ act-order input permutation).
    method: "int8" | "int4" | "fp8" (fp8: weight-only upcast here)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if "perm" in params:
        x2 = jnp.take(x2, params["perm"], axis=1)
    if method == "int8":
        y = int8_matmul(x2, params["qweight"], params["scales"], impl=impl)
    elif method == "int4":
        y = int4_matmul(x2, params["qweight"], params["scales"], params["qzeros"], impl=impl)
    elif method == "fp8":
        w = params["qweight"].astype(jnp.float32) * params["scales"].astype(jnp.float32)[:, None]
        y = _dot_t(x2.astype(jnp.float32), w).astype(x.dtype)
    else:
        raise ValueError(f"unknown quantization method {method!r}")
    if "bias" in params:
        y = y + params["bias"].astype(y.dtype)
    return y.reshape(*lead, y.shape[-1])
