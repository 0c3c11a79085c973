"""Greedy sampling (Triton): the argmax of each logits row and a non-finite flag, in one pass.

``greedy_argmax(logits [R, V]) -> (token_ids int64 [R], nonfinite bool [R])`` for fp16 / bf16 /
fp32 logits whose last dim is contiguous (any row stride, e.g. a vocab slice of a padded
all-gather). The logits are read once, in their own dtype (no float32 copy), and compared in
float32 (an exact upcast, so the result equals that of the float32 copy):

- ``token_ids[r] == torch.argmax(logits[r].float())``, bit for bit, with torch's rules (CPU and
  CUDA alike): the FIRST index of the maximum wins ties (-0.0 == +0.0); a row holding NaN returns
  its first NaN (NaN counts as greater than everything, +inf included); a row of -inf returns 0.
- ``nonfinite[r]`` is True iff row r holds a NaN, +inf or -inf (an exact element test, not a sum).
- With ``bitmask`` (int32 [R, W], W >= ceil(V / 32); bit j of word w allows token 32 w + j, the
  grammar masks of structured output): the argmax of the row with every disallowed logit set to
  -inf, i.e. ``argmax(logits.float().masked_fill(~allowed, -inf))`` (a row that allows nothing
  gives 0, torch's argmax of all -inf); ``nonfinite`` still tests the raw row. The masked greedy
  step then needs no float32 copy, no unpacked [R, V] mask and no masked_fill pass.

Two stages, deterministic: V is cut into ``C`` chunks of whole ``BLOCK`` tiles and a program per
(row, chunk) keeps per-lane running (value, first index, any-non-finite) accumulators over its
tiles, then reduces them to the chunk's (max, first index of it, or first NaN; flag). With C > 1
a second small kernel (one program per row) combines the chunks' results by the same rule; since
each chunk reports the first index of its maximum, the smallest index among the chunks that hold
the row maximum is the row's first. C is chosen so that R * C is about ``TARGET_PROGRAMS``
(a whole GPU busy at R = 1, where one program per row would read the 256 KB row alone), with at
least ``MIN_CHUNK_TILES`` tiles per chunk; with C == 1 the first kernel writes the outputs itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xlaserve.config import KernelConfig

from ._common import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    next_pow2,
    pdl_kwargs,
    pdl_prologue,
    use_pdl,
)

BLOCK = 1024  # elements per tile (8 per thread at 4 warps: 16-byte loads of 16-bit logits)
TARGET_PROGRAMS = 1024  # stage-1 programs aimed at (several per SM on an H200's 132 SMs)
MIN_CHUNK_TILES = 2  # at least 2 tiles (2048 elements) per chunk
_NO_INDEX = 2**31 - 1  # "no index yet": larger than every column index (V < 2^31 - 1)


@triton.jit
def _first_max(v, i, NO_INDEX: tl.constexpr):
    """(value, index) of a vector of (value, index) candidates, torch.argmax's rule: the first
    NaN if any (its value NaN), else the maximum and the smallest index holding it."""
    is_nan = v != v
    nan_i = tl.min(tl.where(is_nan, i, NO_INDEX), axis=0)
    m = tl.max(tl.where(is_nan, float("-inf"), v), axis=0)
    max_i = tl.min(tl.where(v == m, i, NO_INDEX), axis=0)
    has_nan = nan_i < NO_INDEX
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, nan_i, max_i)


# Per-call ints are not specialised: the row count of a step changes its chunking, and Triton
# would otherwise compile a variant per "== 1" / "divisible by 16" case of them mid-serving.
@triton.jit(do_not_specialize=["num_chunks", "tiles_per_chunk"])
def _argmax_chunk_kernel(
    x_ptr,
    m_ptr,
    val_ptr,
    idx_ptr,
    bad_ptr,
    tok_ptr,
    flag_ptr,
    stride_xr,
    stride_mr,
    vocab,
    num_chunks,
    tiles_per_chunk,
    BLOCK: tl.constexpr,
    NO_INDEX: tl.constexpr,
    FINAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    base = x_ptr + row.to(tl.int64) * stride_xr
    mbase = m_ptr + row.to(tl.int64) * stride_mr
    start = chunk * tiles_per_chunk * BLOCK
    acc_v = tl.full([BLOCK], float("-inf"), tl.float32)
    acc_i = tl.full([BLOCK], NO_INDEX, tl.int32)
    acc_bad = tl.zeros([BLOCK], tl.int32)
    for t in range(tiles_per_chunk):
        cols = start + t * BLOCK + offs
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        bad = mask & ((x != x) | (tl.abs(x) == float("inf")))  # the raw row's
        acc_bad = tl.maximum(acc_bad, bad.to(tl.int32))
        if HAS_MASK:  # disallowed tokens -> -inf (32 lanes read one word: a cached broadcast)
            words = tl.load(mbase + cols // 32, mask=mask, other=0)
            x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
        x_nan = x != x
        # Each lane sees increasing columns: a strict ">" keeps the first of equal values; a
        # lane's first column is always taken (an all -inf lane); NaN beats any non-NaN and the
        # first NaN stays (NaN > NaN is false).
        take = mask & ((x > acc_v) | (acc_i == NO_INDEX) | (x_nan & (acc_v == acc_v)))
        acc_v = tl.where(take, x, acc_v)
        acc_i = tl.where(take, cols, acc_i)
    best_v, best_i = _first_max(acc_v, acc_i, NO_INDEX)
    any_bad = tl.max(acc_bad, axis=0)
    if FINAL:
        tl.store(tok_ptr + row, best_i.to(tl.int64))
        tl.store(flag_ptr + row, any_bad.to(flag_ptr.dtype.element_ty))
    else:
        w = row * num_chunks + chunk
        tl.store(val_ptr + w, best_v)
        tl.store(idx_ptr + w, best_i)
        tl.store(bad_ptr + w, any_bad.to(tl.int8))


@triton.jit(do_not_specialize=["num_chunks"])
def _argmax_combine_kernel(
    val_ptr,
    idx_ptr,
    bad_ptr,
    tok_ptr,
    flag_ptr,
    num_chunks,
    BLOCK_C: tl.constexpr,
    NO_INDEX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    w = row * num_chunks + offs
    v = tl.load(val_ptr + w, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + w, mask=mask, other=NO_INDEX)
    bad = tl.load(bad_ptr + w, mask=mask, other=0).to(tl.int32)
    _, best_i = _first_max(v, i, NO_INDEX)
    tl.store(tok_ptr + row, best_i.to(tl.int64))
    tl.store(flag_ptr + row, tl.max(bad, axis=0).to(flag_ptr.dtype.element_ty))


def plan_chunks(rows: int, vocab: int, block: int = BLOCK) -> tuple[int, int, int]:
    """(tile size, tiles per chunk, number of chunks) for logits [rows, vocab]: about
    TARGET_PROGRAMS (row, chunk) programs, at least MIN_CHUNK_TILES tiles per chunk, no empty
    chunk."""
    block = min(block, max(16, next_pow2(vocab)))
    tiles = triton.cdiv(vocab, block)
    chunks = max(1, min(TARGET_PROGRAMS // max(rows, 1), tiles // MIN_CHUNK_TILES))
    per_chunk = triton.cdiv(tiles, chunks)
    return block, per_chunk, triton.cdiv(tiles, per_chunk)


def _max_chunks(vocab: int, block: int) -> int:
    """The most chunks `plan_chunks` gives any row count for this vocab and tile (R = 1)."""
    return max(1, triton.cdiv(vocab, block) // MIN_CHUNK_TILES)


def _launch(
    logits: torch.Tensor,
    tok: torch.Tensor,
    flag: torch.Tensor,
    block: int | None,
    chunks: int | None,
    kernels: KernelConfig | None = None,
    bitmask: torch.Tensor | None = None,
) -> None:
    r, v = logits.shape
    if r == 0:
        return
    blk, per_chunk, n_chunks = plan_chunks(r, v, block or BLOCK)
    if chunks is not None:  # a given number of chunks (tests: chunk boundaries at chosen places)
        tiles = triton.cdiv(v, blk)
        per_chunk = triton.cdiv(tiles, max(1, min(chunks, tiles)))
        n_chunks = triton.cdiv(tiles, per_chunk)
    pdl = use_pdl(logits, kernels)
    final = n_chunks == 1
    if final:
        val = idx = bad = tok  # unused
    else:
        val = torch.empty((r, n_chunks), dtype=torch.float32, device=logits.device)
        idx = torch.empty((r, n_chunks), dtype=torch.int32, device=logits.device)
        bad = torch.empty((r, n_chunks), dtype=torch.int8, device=logits.device)
    has_mask = bitmask is not None
    m = bitmask if has_mask else logits  # unused without a mask
    _argmax_chunk_kernel[(r, n_chunks)](
        logits, m, val, idx, bad, tok, flag, logits.stride(0), m.stride(0) if has_mask else 0,
        v, n_chunks, per_chunk,
        BLOCK=blk, NO_INDEX=_NO_INDEX, FINAL=final, HAS_MASK=has_mask, num_warps=4,
        USE_PDL=pdl, **pdl_kwargs(pdl),
    )  # fmt: skip
    if not final:
        _argmax_combine_kernel[(r,)](
            val, idx, bad, tok, flag, n_chunks,
            # Sized by the vocab's largest chunk count, not this call's: one compile per vocab.
            BLOCK_C=max(16, next_pow2(n_chunks), next_pow2(_max_chunks(v, blk))),
            NO_INDEX=_NO_INDEX, num_warps=4,
            USE_PDL=pdl, **pdl_kwargs(pdl),
        )  # fmt: skip


def _check(name: str, logits: torch.Tensor) -> None:
    if logits.ndim != 2:
        raise ValueError(f"{name}: logits must be [R, V], got shape {tuple(logits.shape)}")
    if logits.shape[1] == 0:
        raise ValueError(f"{name}: V must be > 0 (argmax of an empty row)")
    if logits.shape[1] >= _NO_INDEX:
        raise ValueError(f"{name}: V = {logits.shape[1]} must be < 2^31 - 1")
    check_dtype(name, logits, FLOAT_DTYPES)
    check_device(name, logits)
    check_last_dim_contiguous(name, logits)


def _check_bitmask(name: str, logits: torch.Tensor, bitmask: torch.Tensor | None) -> None:
    if bitmask is None:
        return
    r, v = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.ndim != 2:
        raise ValueError(
            f"{name}: bitmask must be int32 [R, W], got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if bitmask.shape[0] != r or bitmask.shape[1] < -(-v // 32):
        raise ValueError(
            f"{name}: bitmask {tuple(bitmask.shape)} must be [{r}, >= {-(-v // 32)}] for logits "
            f"{tuple(logits.shape)}"
        )
    check_device(name, logits, bitmask)
    check_last_dim_contiguous(f"{name} bitmask", bitmask)


def greedy_argmax(
    logits: torch.Tensor,
    *,
    block: int | None = None,
    chunks: int | None = None,
    kernels: KernelConfig | None = None,
    bitmask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (token_ids int64 [R], nonfinite bool [R]); see the module docstring
    (bitmask: int32 [R, W] allowed-token bits, or None). block / chunks override the tile size
    and the number of chunks per row (tests)."""
    _check("greedy_argmax", logits)
    _check_bitmask("greedy_argmax", logits, bitmask)
    r = logits.shape[0]
    tok = torch.empty(r, dtype=torch.int64, device=logits.device)
    flag = torch.empty(r, dtype=torch.uint8, device=logits.device)
    _launch(logits, tok, flag, block, chunks, kernels, bitmask)
    return tok, flag.view(torch.bool)


def greedy_argmax_packed(
    logits: torch.Tensor,
    *,
    block: int | None = None,
    chunks: int | None = None,
    kernels: KernelConfig | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [R, V] -> int64 [2R]: the token ids of `greedy_argmax`, then its non-finite flags
    as 0 / 1 (what the runner copies to the host in one transfer, without a cat or a cast)."""
    _check("greedy_argmax_packed", logits)
    _check_bitmask("greedy_argmax_packed", logits, bitmask)
    r = logits.shape[0]
    out = torch.empty(2 * r, dtype=torch.int64, device=logits.device)
    _launch(logits, out[:r], out[r:], block, chunks, kernels, bitmask)
    return out


def greedy_argmax_ref(
    logits: torch.Tensor, bitmask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`greedy_argmax`: argmax of the float32 logits (torch's tie and
    NaN rules) with the bitmask's disallowed tokens at -inf, and an element-wise non-finite test
    of the raw logits."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [R, V], got shape {tuple(logits.shape)}")
    x = logits.float()
    bad = ~torch.isfinite(x).all(dim=-1)
    if bitmask is not None:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = (bitmask.to(torch.int32)[:, :, None] >> shifts) & 1  # [R, W, 32]
        allowed = bits.reshape(bitmask.shape[0], -1)[:, : x.shape[1]].bool().to(x.device)
        x = x.masked_fill(~allowed, float("-inf"))
    return x.argmax(dim=-1), bad
