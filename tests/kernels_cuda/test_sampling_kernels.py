"""greedy_argmax: exact torch.argmax (first index of the maximum, first NaN) and an exact
non-finite flag, across tiles, lanes and chunks; strided rows; bad inputs."""

from __future__ import annotations

import pytest
import torch

from xlaserve.kernels_cuda.sampling import (
    MIN_CHUNK_TILES,
    TARGET_PROGRAMS,
    greedy_argmax,
    greedy_argmax_packed,
    greedy_argmax_ref,
    plan_chunks,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(
    x: torch.Tensor, device: torch.device, packed: bool = False, **kw
) -> tuple[list[int], list[bool]]:
    """Run the kernel on x (a CPU tensor) and compare with torch.argmax of x.float(); with
    packed, greedy_argmax_packed too."""
    tok, bad = greedy_argmax(x.to(device), **kw)
    assert tok.dtype == torch.int64 and bad.dtype == torch.bool
    assert tok.shape == bad.shape == (x.shape[0],)
    want_tok, want_bad = greedy_argmax_ref(x)
    assert tok.cpu().tolist() == want_tok.tolist()
    assert bad.cpu().tolist() == want_bad.tolist()
    if packed:
        flat = greedy_argmax_packed(x.to(device), **kw).cpu()
        assert flat.tolist() == want_tok.tolist() + want_bad.long().tolist()
    return tok.cpu().tolist(), bad.cpu().tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 17, 1000, 5000])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_sweep_matches_torch_argmax(rows: int, vocab: int, dtype: torch.dtype, device) -> None:
    g = torch.Generator().manual_seed(rows * 10007 + vocab)
    x = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
    tok, bad = _check(x, device, packed=True)
    assert not any(bad)
    # Few distinct values: many equal maxima per row, the first one must win.
    y = torch.randint(-3, 3, (rows, vocab), generator=g).to(dtype)
    tok, _ = _check(y, device)
    for r in range(rows):
        assert tok[r] == (y[r] == y[r].max()).nonzero()[0].item()


@pytest.mark.parametrize("chunks", [None, 1, 3, 8, 63])
def test_ties_across_tiles_lanes_and_chunks(chunks: int | None, device) -> None:
    # block 16 over V = 1000: 63 tiles; chunks=8 puts 8 tiles (128 columns) in a chunk.
    vocab = 1000
    x = torch.zeros(6, vocab)
    x[0, [900, 130, 700]] = 5.0  # three chunks hold the max: the smallest index wins
    x[1, [37, 53, 21]] = 5.0  # same lane (5) in tiles 1, 2 and another lane of tile 1
    x[2, [128, 127]] = 5.0  # the two sides of a chunk (and tile) boundary
    x[3, [999, 998]] = 5.0  # the end of the last (partial) tile
    x[4, :] = -1.0  # a whole row tied: index 0
    x[5, [0, 999]] = 5.0
    tok, _ = _check(x, device, block=16, chunks=chunks)
    assert tok == [130, 21, 127, 998, 0, 0]
    if chunks == 8:
        for dtype in (torch.bfloat16, torch.float16):
            assert _check(x.to(dtype), device, block=16, chunks=chunks)[0] == tok
    # -0.0 == +0.0: a tie, the first index wins.
    z = torch.full((2, vocab), -1.0)
    z[0, 300], z[0, 40] = 0.0, -0.0
    z[1, 500], z[1, 600] = -0.0, 0.0
    assert _check(z, device, block=16, chunks=chunks)[0] == [40, 500]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunks", [1, 5])
def test_nan_and_inf_rows(dtype: torch.dtype, chunks: int | None, device) -> None:
    vocab = 1000
    x = torch.randn(12, vocab, generator=torch.Generator().manual_seed(5))
    x[0, 999] = NAN  # NaN counts as the maximum ...
    x[1, [800, 50]] = NAN  # ... and the first NaN wins, across chunks
    x[2, 10], x[2, 600] = INF, NAN  # NaN beats an earlier +inf
    x[3, [700, 20]] = INF  # the first +inf; flagged
    x[4, 333] = -INF  # -inf only: argmax unchanged, flagged
    x[5, :] = -INF  # all -inf: index 0, flagged
    x[6, :] = NAN  # all NaN: index 0
    x[7, :] = 3.0e38 if dtype == torch.float32 else 6.0e4  # finite: not flagged
    x[7, 444] = 3.1e38 if dtype == torch.float32 else 6.1e4
    x[8, :] = -INF
    x[8, [900, 901]] = -5.0  # the only finite values of an otherwise -inf row
    x[9, 17], x[9, 18] = NAN, -INF
    # rows 10, 11: plain
    x = x.to(dtype)
    tok, bad = _check(x, device, block=16, chunks=chunks)
    assert tok[:10] == [999, 50, 600, 20, tok[4], 0, 0, 444, 900, 17]
    assert tok[4] == int(x[4].float().argmax()) != 333
    assert bad == [True] * 7 + [False, True, True, False, False]


def test_strided_rows(device) -> None:
    g = torch.Generator().manual_seed(7)
    big = torch.randn(9, 1300, generator=g).to(torch.bfloat16)
    big[:, 1000:] = 100.0  # outside the slice: must not be read as logits
    big[2, 50] = NAN
    for x in (big[:, :1000], big[::2, :1000], big[1:8:3, 3:1000]):
        assert x.stride(0) != x.shape[1]
        _check(x, device, packed=True)
        _check(x, device, packed=True, block=64, chunks=4)


def test_empty_batch_and_plan() -> None:
    tok, bad = greedy_argmax_ref(torch.zeros(0, 5))
    assert tok.shape == bad.shape == (0,)
    for rows, vocab in [(1, 128256), (256, 128256), (3, 1), (7, 5000), (1000, 40000)]:
        block, per_chunk, chunks = plan_chunks(rows, vocab)
        tiles = -(-vocab // block)
        assert (chunks - 1) * per_chunk < tiles <= chunks * per_chunk  # no empty chunk
        assert chunks == 1 or per_chunk >= MIN_CHUNK_TILES
        assert rows * chunks <= max(rows, TARGET_PROGRAMS)
    assert plan_chunks(1, 128256)[2] >= 32  # batch 1: the row is split over many programs


def test_empty_rows_kernel(device) -> None:
    tok, bad = greedy_argmax(torch.zeros(0, 5, device=device))
    assert tok.shape == bad.shape == (0,)
    assert greedy_argmax_packed(torch.zeros(0, 5, device=device)).shape == (0,)


def test_bad_inputs_raise(device) -> None:
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        greedy_argmax(torch.zeros(5, device=device))
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        greedy_argmax(torch.zeros(2, 3, 4, device=device))
    with pytest.raises(ValueError, match="V must be > 0"):
        greedy_argmax(torch.zeros(2, 0, device=device))
    with pytest.raises(ValueError, match="dtype"):
        greedy_argmax(torch.zeros(2, 8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="dtype"):
        greedy_argmax(torch.zeros(2, 8, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        greedy_argmax(torch.zeros(8, 2, device=device).t())
    with pytest.raises(ValueError, match="contiguous"):
        greedy_argmax_packed(torch.zeros(2, 16, device=device)[:, ::2])


def _words(allowed: torch.Tensor, extra_words: int = 0) -> torch.Tensor:
    """bool allowed [R, V] -> the packed int32 [R, ceil(V / 32) + extra_words] bitmask (bit j of
    word w: token 32 w + j; padding bits and extra words all set, as xgrammar leaves them)."""
    r, v = allowed.shape
    w = -(-v // 32) + extra_words
    bits = torch.ones(r, w * 32, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    words = (bits.view(r, w, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", [None, 1, 5])
def test_bitmask_matches_masked_argmax(dtype: torch.dtype, chunks: int | None, device) -> None:
    """With a grammar bitmask: the argmax over the allowed tokens (the reference: masked_fill
    then argmax), the non-finite flag of the raw row, a row allowing nothing -> 0."""
    g = torch.Generator().manual_seed(11)
    rows, vocab = 7, 1000
    x = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
    allowed = torch.rand(rows, vocab, generator=g) < 0.1
    allowed[1] = True  # every token (a row without a grammar: all bits set)
    allowed[2] = False  # nothing: argmax of all -inf is 0
    allowed[3] = False
    allowed[3, [17, 999]] = True  # two tokens, the larger wins
    x[3, 17], x[3, 999] = -50.0, -40.0
    x[3, 500] = 100.0  # the raw maximum, disallowed
    x[4, 300] = NAN  # NaN at a disallowed token: ignored by the argmax, flagged as non-finite
    allowed[4, 300] = False
    x[5, 42] = INF  # an allowed +inf wins
    allowed[5, 42] = True
    mask = _words(allowed, extra_words=1 if dtype == torch.float32 else 0)
    tok, bad = greedy_argmax(x.to(device), bitmask=mask.to(device), block=16, chunks=chunks)
    want_tok, want_bad = greedy_argmax_ref(x, mask)
    assert tok.cpu().tolist() == want_tok.tolist()
    assert bad.cpu().tolist() == want_bad.tolist()
    xf = x.float().masked_fill(~allowed, -INF)
    assert want_tok.tolist() == xf.argmax(dim=-1).tolist()  # the reference is what it says
    assert tok[2].item() == 0 and tok[3].item() == 999 and tok[5].item() == 42
    assert bad.cpu().tolist()[4:6] == [True, True] and not bad[1].item()
    assert all(allowed[r, t] for r, t in enumerate(tok.tolist()) if r != 2)
    flat = greedy_argmax_packed(x.to(device), bitmask=mask.to(device), block=16, chunks=chunks)
    assert flat.cpu().tolist() == want_tok.tolist() + want_bad.long().tolist()


def test_bitmask_bad_inputs_raise(device) -> None:
    x = torch.zeros(2, 100, device=device)
    with pytest.raises(ValueError, match="int32"):
        greedy_argmax(x, bitmask=torch.zeros(2, 4, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"\[2, >= 4\]"):
        greedy_argmax(x, bitmask=torch.zeros(2, 3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"\[2, >= 4\]"):
        greedy_argmax_packed(x, bitmask=torch.zeros(3, 4, dtype=torch.int32, device=device))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 256])
def test_gpu_real_shapes(rows: int) -> None:
    torch.manual_seed(rows)
    vocab = 128256
    x = (3 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    x[0, [70000, 90000]] = 40.0  # a tie across chunks
    if rows > 1:
        x[1, [5, 127000]] = NAN
        x[2, 64000] = INF
        x[3, :] = -INF
        x[4, :] = 1.0
    tok, bad = greedy_argmax(x)
    assert torch.equal(tok, x.float().argmax(dim=-1))  # torch's CUDA argmax
    assert torch.equal(tok.cpu(), x.cpu().float().argmax(dim=-1))  # and its CPU one
    assert torch.equal(bad, ~torch.isfinite(x).all(dim=-1))
    assert tok[0].item() == 70000
    if rows > 1:
        assert tok[1:5].tolist() == [5, 64000, 0, 0]
        assert bad[1:5].tolist() == [True, True, True, False]
    packed = greedy_argmax_packed(x)
    assert torch.equal(packed, torch.cat([tok, bad.long()]))
    # With grammar bitmasks (a few hundred allowed tokens a row; row 0 allows everything).
    allowed = torch.rand(rows, vocab, device="cuda") < 0.003
    allowed[0] = True
    mask = _words(allowed.cpu()).cuda()
    mtok, mbad = greedy_argmax(x, bitmask=mask)
    want_tok, want_bad = greedy_argmax_ref(x, mask)
    assert torch.equal(mtok, want_tok) and torch.equal(mbad, want_bad)
    assert torch.equal(mtok, x.float().masked_fill(~allowed, -INF).argmax(dim=-1))
    assert mtok[0].item() == tok[0].item()
    # A vocab slice of a wider (padded, all-gathered) tensor.
    wide = torch.randn(rows, vocab + 64, device="cuda", dtype=torch.bfloat16)
    wide[:, vocab:] = 1e4
    tok, _ = greedy_argmax(wide[:, :vocab])
    assert torch.equal(tok, wide[:, :vocab].float().argmax(dim=-1))
