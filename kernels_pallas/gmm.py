"""Grouped matmul (megablox-style) for mixture-of-experts experts.

`gmm(lhs, rhs, group_sizes)`: the rows of lhs are sorted by group (expert); rows
[offset[g], offset[g] + group_sizes[g]) are multiplied by rhs[g]:

    lhs [M, K], rhs [G, K, N] (or [G, N, K] with transpose_rhs=True, the torch [out, in] layout
    that expert weights are stored in), group_sizes int32 [G] -> out [M, N]
    rows >= sum(group_sizes) are zero.

Implementations (`impl`):
- "pallas_tpu": the Mosaic kernel below. Grid (N tiles, visits, K tiles): a "visit" is one
  (group, M tile) pair whose rows overlap; visits are ordered by group, hence by M tile, so the
  visits of one output tile are consecutive and its block stays in VMEM while each group writes
  its own rows (masked). At most tiles_m + G - 1 visits; the unused tail repeats the last visit
  (an idempotent rewrite). The visit table is scalar-prefetched into SMEM. Runs on CPU under
  TPU interpret mode (no ref reshapes).
- "xla": `jax.lax.ragged_dot_general` (a native grouped GEMM where XLA has one; a masked dense
  decomposition on CPU).
- "reference": every group on every row, then a per-row select (O(G*M*K*N)); tests only.
- "auto": pallas_tpu on TPU or under forced TPU interpret mode, else xla.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from xlaserve.kernels_pallas import compat

_IMPLS = ("auto", "pallas_tpu", "xla", "reference")


@dataclass(frozen=True)
class GmmBlockSizes:
    """Tile sizes (rows tm, contraction tk, columns tn); clamped to the (padded) problem."""

    tm: int = 128
    tk: int = 512
    tn: int = 512


# Tuned per dtype (data, not code): bf16 tiles fit v5e/v6e VMEM double-buffered.
TUNED_BLOCK_SIZES: dict[str, GmmBlockSizes] = {
    "bfloat16": GmmBlockSizes(tm=128, tk=512, tn=512),
    "float32": GmmBlockSizes(tm=128, tk=256, tn=512),
}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tile(dim: int, want: int, align: int) -> tuple[int, int]:
    """(tile, padded dim): one full-dim tile when dim <= want, else `want` (a multiple of align)."""
    if dim <= want:
        return dim, dim
    t = max(align, want // align * align)
    return t, _round_up(dim, t)


def _check(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, transpose_rhs: bool) -> None:
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"gmm needs lhs [M, K] and rhs [G, K, N]; got {lhs.shape}, {rhs.shape}")
    k_rhs = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if lhs.shape[1] != k_rhs:
        raise ValueError(
            f"gmm contraction mismatch: lhs K={lhs.shape[1]}, rhs K={k_rhs} "
            f"(rhs {rhs.shape}, transpose_rhs={transpose_rhs})"
        )
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be an integer [G={rhs.shape[0]}] array, got "
            f"{group_sizes.dtype}{list(group_sizes.shape)}"
        )


def ref_gmm(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, transpose_rhs: bool = False
) -> jax.Array:
    """Plain jnp reference (see module docstring); float32 accumulation, output in lhs dtype."""
    w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs  # [G, K, N]
    full = jnp.einsum(
        "mk,gkn->gmn", lhs, w, preferred_element_type=jnp.float32, precision="highest"
    )
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[0])
    gid = jnp.searchsorted(ends, rows, side="right")  # group of each row (G past the end)
    out = jnp.take_along_axis(full, jnp.minimum(gid, rhs.shape[0] - 1)[None, :, None], axis=0)[0]
    return jnp.where((gid < rhs.shape[0])[:, None], out, 0).astype(lhs.dtype)


def _xla_gmm(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, transpose_rhs: bool
) -> jax.Array:
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2 if transpose_rhs else 1]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    out = jax.lax.ragged_dot_general(
        lhs, rhs, group_sizes.astype(jnp.int32), dn, preferred_element_type=jnp.float32
    )
    rows = jnp.arange(lhs.shape[0])[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, 0).astype(lhs.dtype)


def make_visits(
    group_sizes: jax.Array, tm: int, m_padded: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Visit table of the kernel: (group offsets [G+1], group id [V], M tile id [V]) int32, with
    V = tiles_m + G - 1 static; the unused tail repeats the last real visit."""
    g = group_sizes.shape[0]
    tiles_m = m_padded // tm
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    first = starts // tm
    count = jnp.where(sizes > 0, (ends - 1) // tm - first + 1, 0)
    cum = jnp.cumsum(count)  # visits up to and including group g
    num_visits = tiles_m + g - 1
    i = jnp.minimum(jnp.arange(num_visits, dtype=jnp.int32), jnp.maximum(cum[-1] - 1, 0))
    gid = jnp.minimum(jnp.searchsorted(cum, i, side="right"), g - 1).astype(jnp.int32)
    tile = first[gid] + i - (cum[gid] - count[gid])
    return offsets, gid, jnp.clip(tile, 0, tiles_m - 1).astype(jnp.int32)


def _gmm_kernel(
    offsets_ref,  # noqa: ANN001 - SMEM int32 [G+1]
    gid_ref,  # noqa: ANN001 - SMEM int32 [V]
    tile_ref,  # noqa: ANN001 - SMEM int32 [V]
    lhs_ref,  # noqa: ANN001 - VMEM [tm, tk]
    rhs_ref,  # noqa: ANN001 - VMEM [tk, tn] or [tn, tk]
    out_ref,  # noqa: ANN001 - VMEM [tm, tn]
    acc_ref,  # noqa: ANN001 - VMEM f32 [tm, tn]
    *,
    transpose_rhs: bool,
    tm: int,
) -> None:
    v, k = pl.program_id(1), pl.program_id(2)

    @pl.when(k == 0)
    def _zero() -> None:
        acc_ref[...] = jnp.zeros_like(acc_ref)

    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
    acc_ref[...] += jax.lax.dot_general(
        lhs_ref[...], rhs_ref[...], (contract, ((), ())), preferred_element_type=jnp.float32
    )

    @pl.when(k == pl.num_programs(2) - 1)
    def _store() -> None:
        g, tile = gid_ref[v], tile_ref[v]
        prev_tile = tile_ref[jnp.maximum(v - 1, 0)]
        first_visit = jnp.logical_or(v == 0, prev_tile != tile)
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = jnp.logical_and(rows >= offsets_ref[g], rows < offsets_ref[g + 1])
        keep = jnp.where(first_visit, jnp.zeros_like(out_ref), out_ref[...])
        out_ref[...] = jnp.where(mine, acc_ref[...].astype(out_ref.dtype), keep)


def _pallas_gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    transpose_rhs: bool,
    bs: GmmBlockSizes,
) -> jax.Array:
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, mp = _tile(_round_up(m, 8), bs.tm, 8)
    tk, kp = _tile(k, bs.tk, 128)
    tn, np_ = _tile(n, bs.tn, 128)
    lhs = jnp.pad(lhs, ((0, mp - m), (0, kp - k)))
    pad_rhs = ((0, 0), (0, np_ - n), (0, kp - k)) if transpose_rhs else ((0, 0), (0, kp - k), (0, np_ - n))  # fmt: skip
    rhs = jnp.pad(rhs, pad_rhs)
    offsets, gid, tiles = make_visits(group_sizes, tm, mp)
    num_visits = gid.shape[0]
    if transpose_rhs:
        rhs_spec = pl.BlockSpec((None, tn, tk), lambda j, v, kk, o, g, t: (g[v], j, kk))
    else:
        rhs_spec = pl.BlockSpec((None, tk, tn), lambda j, v, kk, o, g, t: (g[v], kk, j))
    grid_spec = compat.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(np_ // tn, num_visits, kp // tk),
        in_specs=[pl.BlockSpec((tm, tk), lambda j, v, kk, o, g, t: (t[v], kk)), rhs_spec],
        out_specs=pl.BlockSpec((tm, tn), lambda j, v, kk, o, g, t: (t[v], j)),
        scratch_shapes=[compat.VMEM((tm, tn), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, transpose_rhs=transpose_rhs, tm=tm),
        out_shape=jax.ShapeDtypeStruct((mp, np_), lhs.dtype),
        grid_spec=grid_spec,
        compiler_params=compat.compiler_params(("parallel", "arbitrary", "arbitrary")),
    )(offsets, gid, tiles, lhs, rhs)
    rows = jnp.arange(m)[:, None]
    return jnp.where(rows < offsets[-1], out[:m, :n], 0)


def _resolve_impl(impl: str) -> str:
    if impl != "auto":
        return impl
    if jax.default_backend() == "tpu" or compat.is_interpret_forced():
        return "pallas_tpu"
    return "xla"


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "impl", "block_sizes"))
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    transpose_rhs: bool = False,
    impl: str = "auto",
    block_sizes: GmmBlockSizes | None = None,
) -> jax.Array:
    """Grouped matmul: lhs [M, K] (rows sorted by group), rhs [G, K, N] ([G, N, K] when
    transpose_rhs), group_sizes int [G] -> [M, N] in lhs dtype (float32 accumulation).
    ValueError on mismatched shapes or an unknown impl."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    _check(lhs, rhs, group_sizes, transpose_rhs)
    impl = _resolve_impl(impl)
    if impl == "reference":
        return ref_gmm(lhs, rhs, group_sizes, transpose_rhs)
    if impl == "xla":
        return _xla_gmm(lhs, rhs, group_sizes, transpose_rhs)
    bs = block_sizes or TUNED_BLOCK_SIZES.get(jnp.dtype(lhs.dtype).name, GmmBlockSizes())
    return _pallas_gmm(lhs, rhs, group_sizes, transpose_rhs, bs)
