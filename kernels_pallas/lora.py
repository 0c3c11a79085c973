"""Batched multi-LoRA (punica-style shrink / expand), segmented by each token's adapter slot.

Contract (xlaserve/lora): slot tables A [S, R, in] and B [S, out, R] (S = max_loras slots,
R = max_lora_rank, adapters zero-padded to R, B already scaled); slots int32 [T], the slot of
each token, -1 (or any value outside [0, S)) = base model, no delta.

    lora_shrink(x [T, in], A, slots)              -> s [T, R]     s_t = A[slot_t] @ x_t
    lora_expand(y [T, N], s [T, R], B, slots, off) -> y            y_t[off:off+out] += B[slot_t] @ s_t

`off` is a static output column offset, for a fused projection whose output holds several
modules side by side (qkv, gate_up): each part's B is expanded into its own columns. Rows of a
-1 token get no delta. Accumulation is float32; s and the result keep x's / y's dtype.

Implementations (`impl`):
- "reference": gather A[slot_t] / B[slot_t] per token and einsum (materializes [T, R, in]; tests).
- "xla": the one-hot form: s_all = x @ A_all^T [T, S, R], masked to each token's slot, expanded
  with one einsum over (slot, rank). S times the LoRA flops of the gathered form but only plain
  dots XLA fuses, no per-token weight gather; the CPU default (and the tensor-parallel path:
  GSPMD partitions einsums, not pallas_calls).
- "pallas_tpu": tokens sorted by slot (`LoRASegments`, -1 last) and the grouped matmul of
  kernels_pallas/gmm.py (Mosaic; TPU interpret mode on CPU) for both shrink and expand.
- "pallas_gpu": the same segments through `segment_matmul_gpu`, a Pallas kernel lowered through
  Triton (Pallas' interpreter on CPU): one program per (segment tile, output tile) loads its
  segment's weight rows and does a tensor-core dot; tiles never straddle segments.
- "auto": pallas_tpu on TPU (or under forced TPU interpret mode), pallas_gpu on GPU, xla
  elsewhere.

`LoRASegments` (the sort) depends only on the slots, so a forward computes it once and every
layer's shrink / expand reuse it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from xlaserve.config import LORA_IMPLS  # noqa: F401 - re-exported (KernelConfig.lora_impl)
from xlaserve.kernels_pallas import compat


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["slots", "perm", "inv", "group_sizes"],
    meta_fields=[],
)
@dataclass(frozen=True)
class LoRASegments:
    """Tokens grouped by slot. slots i32 [T]; perm i32 [T]: sorted position -> token (slot
    order, base tokens last, stable); inv i32 [T]: token -> sorted position; group_sizes i32 [S]:
    tokens per slot (base tokens are past their sum)."""

    slots: jax.Array
    perm: jax.Array
    inv: jax.Array
    group_sizes: jax.Array


def make_segments(slots: jax.Array, num_slots: int) -> LoRASegments:
    """Group the tokens of `slots` i32 [T] by slot (see LoRASegments)."""
    slots = slots.astype(jnp.int32)
    key = jnp.where((slots >= 0) & (slots < num_slots), slots, num_slots)
    perm = jnp.argsort(key, stable=True).astype(jnp.int32)
    inv = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=jnp.int32))
    sizes = jnp.zeros((num_slots + 1,), jnp.int32).at[key].add(1)[:num_slots]
    return LoRASegments(slots, perm, inv, sizes)


def _check(x: jax.Array, w: jax.Array, slots: jax.Array, what: str) -> None:
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"lora {what}: need x [T, K] and table [S, N, K]; got {x.shape} and {w.shape}"
        )
    if slots.shape != (x.shape[0],):
        raise ValueError(f"lora {what}: slots must be [T={x.shape[0]}], got {slots.shape}")


def resolve_impl(impl: str) -> str:
    """ "auto" -> the implementation for this platform (module docstring)."""
    if impl not in LORA_IMPLS:
        raise ValueError(f"lora impl must be one of {LORA_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if jax.default_backend() == "tpu" or compat.is_interpret_forced():
        return "pallas_tpu"
    if jax.default_backend() == "gpu":
        return "pallas_gpu"
    return "xla"


def _onehot(slots: jax.Array, num_slots: int, dtype: jnp.dtype) -> jax.Array:
    """[T, S]: 1 at each token's slot; all zero for a base (-1) token."""
    return (slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)[None, :]).astype(dtype)


def _apply_rows(w: jax.Array, x: jax.Array, seg: LoRASegments, impl: str) -> jax.Array:
    """out_t = W[slot_t] @ x_t for every token: x [T, K], W [S, N, K] -> float32 [T, N] (zero
    rows for base tokens)."""
    s = w.shape[0]
    if impl == "reference":
        idx = jnp.clip(seg.slots, 0, s - 1)
        out = jnp.einsum(
            "tk,tnk->tn", x, w[idx], preferred_element_type=jnp.float32, precision="highest"
        )
        return jnp.where(((seg.slots >= 0) & (seg.slots < s))[:, None], out, 0.0)
    xs = x[seg.perm]  # rows in slot order, base tokens last (past sum(group_sizes): zero)
    if impl == "pallas_tpu":
        from xlaserve.kernels_pallas.gmm import gmm

        out = gmm(xs, w, seg.group_sizes, transpose_rhs=True, impl="pallas_tpu")
    else:
        out = segment_matmul_gpu(xs, w, seg.group_sizes)
    return out[seg.inv].astype(jnp.float32)


def lora_shrink(x: jax.Array, a: jax.Array, seg: LoRASegments, impl: str = "auto") -> jax.Array:
    """s [T, R] = A[slot_t] @ x_t (zero for base tokens), in x's dtype. x [T, in], a [S, R, in]."""
    _check(x, a, seg.slots, "shrink")
    impl = resolve_impl(impl)
    if impl == "xla":
        num_slots, r = a.shape[0], a.shape[1]
        s_all = jnp.einsum("tk,sk->ts", x, a.reshape(num_slots * r, -1),
                           preferred_element_type=jnp.float32)  # fmt: skip
        s_all = (
            s_all.reshape(-1, num_slots, r) * _onehot(seg.slots, num_slots, jnp.float32)[..., None]
        )
        return s_all.sum(axis=1).astype(x.dtype)
    return _apply_rows(a, x, seg, impl).astype(x.dtype)


def lora_expand(
    y: jax.Array,
    s: jax.Array,
    b: jax.Array,
    seg: LoRASegments,
    offset: int = 0,
    impl: str = "auto",
) -> jax.Array:
    """y [T, N] with y_t[offset : offset + out] += B[slot_t] @ s_t (base tokens unchanged);
    s [T, R], b [S, out, R]; offset static."""
    _check(s, b, seg.slots, "expand")
    out_f = b.shape[1]
    if y.ndim != 2 or y.shape[0] != s.shape[0] or not 0 <= offset <= y.shape[1] - out_f:
        raise ValueError(
            f"lora expand: y {y.shape} has no columns [{offset}, {offset + out_f}) for {s.shape[0]} tokens"
        )
    impl = resolve_impl(impl)
    if impl == "xla":
        num_slots = b.shape[0]
        s_all = s[:, None, :] * _onehot(seg.slots, num_slots, s.dtype)[..., None]  # [T, S, R]
        # One 2D dot over (slot, rank): [T, S*R] @ [S*R, out] (2-5x faster on XLA:CPU than a
        # dot with two contracting dims, measured at tiny and 1k x 4k shapes).
        b_t = jnp.swapaxes(b, 1, 2).reshape(num_slots * b.shape[2], out_f)
        delta = jnp.dot(s_all.reshape(s.shape[0], -1), b_t, preferred_element_type=jnp.float32)
    else:
        delta = _apply_rows(b, s.astype(b.dtype), seg, impl)
    part = y[:, offset : offset + out_f].astype(jnp.float32) + delta
    return lax.dynamic_update_slice(y, part.astype(y.dtype), (0, offset))


def lora_delta_ref(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """The plain definition, float32 [T, out]: (A[slot_t] @ x_t) then B[slot_t] @ that, zero for
    base tokens (gather per token, einsum)."""
    s = a.shape[0]
    ok = (slots >= 0) & (slots < s)
    idx = jnp.clip(slots, 0, s - 1)
    hp = "highest"
    sh = jnp.einsum("ti,tri->tr", x.astype(jnp.float32), a[idx].astype(jnp.float32), precision=hp)
    out = jnp.einsum("tr,tor->to", sh, b[idx].astype(jnp.float32), precision=hp)
    return jnp.where(ok[:, None], out, 0.0)


# ---- the Pallas GPU (Triton) segmented matmul ---------------------------------------------------


@dataclass(frozen=True)
class SegmentBlockSizes:
    """Rows per tile (bt), output columns per program (bn), contraction step (bk); powers of
    two >= 16 (Triton dots); clamped down to the problem where it is smaller. k_splits: the
    contraction cut into that many chunks on a third grid axis (float32 partials summed by the
    wrapper); None = enough to give the grid ~FEW_PROGRAMS programs (the shrink: N = rank is one
    column tile, K = hidden is long)."""

    bt: int = 32
    bn: int = 64
    bk: int = 64
    num_warps: int = 4
    num_stages: int = 2
    k_splits: int | None = None


# Below this many programs the grid cannot fill an H200 (132 SMs, ~2 programs each).
FEW_PROGRAMS = 264


def _pow2_at_least(x: int, lo: int = 16) -> int:
    p = lo
    while p < x:
        p *= 2
    return p


def _tile_map(sizes: jax.Array, bt: int, num_tiles: int) -> tuple[jax.Array, jax.Array]:
    """(group, first sorted row) of each row tile; tiles never straddle groups; tiles past the
    real count have group -1."""
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    count = (sizes + bt - 1) // bt
    cum = jnp.cumsum(count)
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(cum, i, side="right"), sizes.shape[0] - 1).astype(jnp.int32)
    row0 = starts[g] + (i - (cum[g] - count[g])) * bt
    live = i < cum[-1]
    return jnp.where(live, g, -1), jnp.where(live, row0, 0)


def _segment_kernel(
    tile_group_ref,  # noqa: ANN001 - i32 [num_tiles]
    tile_row_ref,  # noqa: ANN001 - i32 [num_tiles]
    ends_ref,  # noqa: ANN001 - i32 [G]: end row of each group
    x_ref,  # noqa: ANN001 - [M, K]
    w_ref,  # noqa: ANN001 - [G * N, K]
    o_ref,  # noqa: ANN001 - [M, N]
    *,
    bt: int,
    bn: int,
    bk: int,
    m: int,
    n: int,
    k: int,
    steps: int,
    splits: int,
) -> None:
    tile, j = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2) if splits > 1 else 0
    g = tile_group_ref[tile]

    @pl.when(g >= 0)
    def _work() -> None:
        row0 = tile_row_ref[tile]
        rows = row0 + lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
        row_ok = rows < ends_ref[g]
        cols = j * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)
        col_ok = cols < n
        # All-array (clamped) indices: a pointer tensor in Triton, and the interpreter's one
        # supported form; masks keep everything past the segment / the matrix at zero.
        rows_c = jnp.clip(rows, 0, m - 1)
        wrows = (g * n + jnp.clip(cols, 0, n - 1)).reshape(bn, 1)

        def body(step, acc):  # noqa: ANN001, ANN202
            ks = step * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            k_ok = ks < k
            ks_c = jnp.clip(ks, 0, k - 1)
            xb = compat.gpu_load(x_ref.at[rows_c, ks_c], mask=row_ok & k_ok, other=0)
            wb = compat.gpu_load(w_ref.at[wrows, ks_c], mask=col_ok.reshape(bn, 1) & k_ok, other=0)
            return acc + lax.dot_general(
                xb, wb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )

        acc = lax.fori_loop(
            split * steps, split * steps + steps, body, jnp.zeros((bt, bn), jnp.float32)
        )
        # A slice store into the padded output ([splits, M + BT, N padded to BN]): never out of
        # bounds, so the interpreter's clamped dynamic slices never shift it.
        mask = row_ok & col_ok
        if splits == 1:
            compat.gpu_store(o_ref.at[pl.ds(row0, bt), pl.ds(j * bn, bn)],
                             acc.astype(o_ref.dtype), mask=mask)  # fmt: skip
        else:  # all-slice indexing (the interpreter does not mix scalars and slices)
            compat.gpu_store(o_ref.at[pl.ds(split, 1), pl.ds(row0, bt), pl.ds(j * bn, bn)],
                             acc[None], mask=mask[None])  # fmt: skip


def segment_matmul_gpu(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    block_sizes: SegmentBlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Grouped matmul over sorted rows (the Pallas Triton kernel): x [M, K] (rows sorted by
    group), w [G, N, K], group_sizes i32 [G] -> [M, N] in x's dtype, float32 accumulation;
    rows past sum(group_sizes) are zero. interpret None: Pallas' interpreter unless on a GPU."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    bs = block_sizes or SegmentBlockSizes()
    m, k = x.shape
    g, n, _ = w.shape
    bt = min(bs.bt, _pow2_at_least(m))
    bn = min(bs.bn, _pow2_at_least(n))
    bk = min(bs.bk, _pow2_at_least(k))
    num_tiles = -(-m // bt) + g  # each group adds at most one partial tile
    n_tiles, k_steps = -(-n // bn), -(-k // bk)
    splits = bs.k_splits or max(1, -(-FEW_PROGRAMS // (num_tiles * n_tiles)))
    splits = max(1, min(splits, k_steps))
    steps = -(-k_steps // splits)
    splits = -(-k_steps // steps)  # no empty split
    tile_group, tile_row = _tile_map(group_sizes, bt, num_tiles)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    kernel = functools.partial(_segment_kernel, bt=bt, bn=bn, bk=bk, m=m, n=n, k=k,
                               steps=steps, splits=splits)  # fmt: skip
    out_dtype = x.dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, n_tiles) + ((splits,) if splits > 1 else ()),
        out_shape=jax.ShapeDtypeStruct(
            ((splits,) if splits > 1 else ()) + (m + bt, n_tiles * bn), out_dtype
        ),  # fmt: skip
        compiler_params=compat.gpu_compiler_params(bs.num_warps, bs.num_stages),
        interpret=interpret,
        name=f"xlaserve_lora_segment_t{bt}_n{bn}_k{bk}_s{splits}",
    )(tile_group, tile_row, ends, x, w.astype(x.dtype).reshape(g * n, k))
    # Rows no tile owns (base tokens) were never written.
    out = out[:m, :n] if splits == 1 else out[:, :m, :n].sum(axis=0).astype(x.dtype)
    return jnp.where(jnp.arange(m)[:, None] < ends[-1], out, jnp.zeros((), out.dtype))
