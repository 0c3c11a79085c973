"""Long-context decode path (issue 24): the wide-tile configs that decode launches with many
splits take, against unified_attention_ref in the Triton interpreter on small shapes (the
override forces the tile shape the GPU tables pick), plus the table pick and the split heuristic.
"""

from __future__ import annotations

import pytest
import torch

from xlaserve.kernels_cuda import paged_attention as pa
from xlaserve.kernels_cuda.kv_quant import quantize_kv
from xlaserve.kernels_cuda.paged_attention import unified_attention, unified_attention_ref

from .test_paged_attention import _batch

# The long-decode tile shape (BLOCK_N 128) and a narrower one wider than the page, both with
# pipelining on; head 32 keeps the interpreter fast.
WIDE = {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}
MID = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}


def _call(fn, batch: dict, splits: int, cfg: dict | None, **kw) -> torch.Tensor:  # noqa: ANN001
    extra = {} if fn is unified_attention_ref else {"launch_config": cfg}
    return fn(
        batch["q"], batch["k_cache"], batch["v_cache"], None, batch["query_start_loc"],
        batch["seq_lens"], batch["block_tables"], batch["max_query_len"], batch["max_seq_len"],
        batch["sm_scale"], kw.pop("window", None), None, num_kv_splits=splits, **kw, **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    "cfg,splits,seq_lens",
    [
        # 300 keys over 64 splits of 128-key tiles: 3 tiles, 61 empty splits; 300 % 128 != 0
        (WIDE, 64, [300, 45]),
        (WIDE, 16, [1000, 129, 1]),  # a 1-key context and one just past a tile
        (MID, 32, [517, 77]),
        (WIDE, 1, [390]),  # no split-KV: the single-program path with wide tiles
    ],
    ids=["wide-64-empty-splits", "wide-16", "mid-32", "wide-1"],
)
def test_long_decode_configs_match_reference(device, tolerances, cfg, splits, seq_lens) -> None:
    """GQA (8 q / 2 kv heads), pages of 16 scattered, contexts not multiples of page/BLOCK_N."""
    batch = _batch([1] * len(seq_lens), seq_lens, 8, 2, 32, 16, torch.float32, device, seed=3)
    out = _call(unified_attention, batch, splits, cfg)
    ref = _call(unified_attention_ref, batch, splits, None)
    atol, rtol = tolerances[torch.float32]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("window,chunk", [(100, None), (None, 96), (200, 128)])
def test_long_decode_window_and_chunk(device, tolerances, window, chunk) -> None:
    """Sliding window and chunked attention start the key range mid-context: with 128-key tiles
    and 16 splits most splits are empty and the first tile is partly masked."""
    batch = _batch([1, 1], [700, 260], 8, 2, 32, 16, torch.float32, device, seed=5)
    out = _call(unified_attention, batch, 16, WIDE, window=window, chunk_size=chunk)
    ref = _call(unified_attention_ref, batch, 16, None, window=window, chunk_size=chunk)
    atol, rtol = tolerances[torch.float32]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def test_long_decode_fp8_kv(device, tolerances) -> None:
    """fp8 codes dequantized in the inner loop of the wide-tile path."""
    batch = _batch([1, 1], [600, 33], 8, 2, 32, 16, torch.float32, device, seed=7)
    kq, ks = quantize_kv(batch["k_cache"], torch.float8_e4m3fn)
    vq, vs = quantize_kv(batch["v_cache"], torch.float8_e4m3fn)
    batch = dict(batch, k_cache=kq, v_cache=vq)
    out = _call(unified_attention, batch, 32, WIDE, k_scale=ks, v_scale=vs)
    ref = _call(unified_attention_ref, batch, 32, None, k_scale=ks, v_scale=vs)
    atol, rtol = tolerances[torch.float32]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def test_table_pick_by_splits(monkeypatch) -> None:  # noqa: ANN001
    """With LONG_DECODE_ENABLED (the default, measured), decode launches with >=
    LONG_DECODE_MIN_SPLITS splits over an unquantized cache take LONG_DECODE_CONFIGS; fewer
    splits, prefill and head 256 keep the earlier tables, quantized caches their own
    (QUANT_DECODE_CONFIGS); disabled, every launch keeps them."""
    few = pa.LONG_DECODE_MIN_SPLITS // 2
    many = pa.LONG_DECODE_MIN_SPLITS
    assert pa.LONG_DECODE_ENABLED
    quant = pa.attention_launch_config(1, 4, 128, False, many, quant=True)
    assert quant["num_stages"] == pa.QUANT_DECODE_CONFIGS[128]["num_stages"]
    assert quant["num_stages"] != pa.LONG_DECODE_CONFIGS[128]["num_stages"]
    monkeypatch.setattr(pa, "LONG_DECODE_ENABLED", False)
    off = pa.attention_launch_config(1, 4, 128, False, many)
    assert off["BLOCK_N"] == pa.ATTENTION_CONFIGS["decode"][128]["BLOCK_N"]
    monkeypatch.setattr(pa, "LONG_DECODE_ENABLED", True)
    long_cfg = pa.attention_launch_config(1, 4, 128, False, many)
    assert long_cfg["BLOCK_N"] == pa.LONG_DECODE_CONFIGS[128]["BLOCK_N"]
    assert long_cfg["num_stages"] == pa.LONG_DECODE_CONFIGS[128]["num_stages"]
    short = pa.attention_launch_config(1, 4, 128, False, few)
    assert short["BLOCK_N"] == pa.ATTENTION_CONFIGS["decode"][128]["BLOCK_N"]
    prefill = pa.attention_launch_config(64, 4, 128, False, many)
    assert prefill["BLOCK_M"] == pa.ATTENTION_CONFIGS["prefill"][128]["BLOCK_M"]
    big = pa.attention_launch_config(1, 4, 256, False, many)
    assert big["BLOCK_N"] == pa.ATTENTION_CONFIGS["decode"][256]["BLOCK_N"]
    # BLOCK_Q, which sizes the grid before the split count is known, does not move with it.
    assert long_cfg["BLOCK_Q"] == short["BLOCK_Q"]
    with pytest.raises(ValueError, match="override lacks"):
        pa.attention_launch_config(1, 4, 128, False, 1, {"BLOCK_N": 64})


def test_quant_decode_tiles_where_set(monkeypatch, device, tolerances) -> None:  # noqa: ANN001
    """QUANT_DECODE_CONFIGS gives decode launches over a quantized cache their own tiles for
    the buckets it has (D 128: 128 keys, measured); unquantized decode, prefill and other
    buckets keep their tables; a 128-key tile over an fp8 cache computes the reference's
    attention."""
    assert set(pa.QUANT_DECODE_CONFIGS) == {128}
    assert pa.attention_launch_config(1, 4, 128, False, 1, quant=True)["BLOCK_N"] == 128
    table = pa.ATTENTION_CONFIGS["decode"][128]
    monkeypatch.delitem(pa.QUANT_DECODE_CONFIGS, 128)
    assert (
        pa.attention_launch_config(1, 4, 128, False, 1, quant=True)["BLOCK_N"] == table["BLOCK_N"]
    )
    tile = {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
    monkeypatch.setitem(pa.QUANT_DECODE_CONFIGS, 128, tile)
    got = pa.attention_launch_config(1, 4, 128, False, 1, quant=True)
    assert {k: got[k] for k in tile} == tile and got["BLOCK_Q"] == 4
    assert pa.attention_launch_config(1, 4, 128, False, 1)["BLOCK_N"] == table["BLOCK_N"]
    assert (
        pa.attention_launch_config(64, 4, 128, False, 1, quant=True)["BLOCK_M"]
        == (pa.ATTENTION_CONFIGS["prefill"][128]["BLOCK_M"])
    )
    assert (
        pa.attention_launch_config(1, 4, 64, False, 1, quant=True)["BLOCK_N"]
        == (pa.ATTENTION_CONFIGS["decode"][64]["BLOCK_N"])
    )
    batch = _batch([1, 1, 1], [300, 77, 129], 8, 2, 32, 16, torch.bfloat16, device, seed=4)
    kq, ks = quantize_kv(batch["k_cache"].float(), torch.float8_e4m3fn)
    vq, vs = quantize_kv(batch["v_cache"].float(), torch.float8_e4m3fn)
    qb = dict(batch, k_cache=kq, v_cache=vq)
    ref = _call(unified_attention_ref, qb, 1, None, k_scale=ks, v_scale=vs).float()
    out = _call(unified_attention, qb, 1, tile, k_scale=ks, v_scale=vs).float()
    atol, rtol = tolerances[torch.bfloat16]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def test_wide_prefill_tiles_where_shared_memory_allows() -> None:
    """Prefill over an unquantized cache on a GPU with PREFILL_WIDE_SMEM takes
    PREFILL_WIDE_CONFIGS (D=128); other GPUs, quantized caches, decode launches, D=64 / 256
    keep the tables; BLOCK_Q (the grid) is the same either way; the CPU never counts as wide."""
    prefill = pa.ATTENTION_CONFIGS["prefill"]
    wide = pa.attention_launch_config(64, 4, 128, False, 1, wide=True)
    assert {k: wide[k] for k in pa.PREFILL_WIDE_CONFIGS[128]} == pa.PREFILL_WIDE_CONFIGS[128]
    assert pa.PREFILL_WIDE_CONFIGS[128] != prefill[128]
    narrow = pa.attention_launch_config(64, 4, 128, False, 1)
    assert {k: narrow[k] for k in prefill[128]} == prefill[128]
    assert wide["BLOCK_Q"] == narrow["BLOCK_Q"]
    quant = pa.attention_launch_config(64, 4, 128, False, 1, quant=True, wide=True)
    assert {k: quant[k] for k in prefill[128]} == prefill[128]
    decode = pa.attention_launch_config(1, 4, 128, False, 1, wide=True)
    assert decode["BLOCK_N"] == pa.ATTENTION_CONFIGS["decode"][128]["BLOCK_N"]
    for d in (64, 256):
        other = pa.attention_launch_config(64, 4, d, False, 1, wide=True)
        assert {k: other[k] for k in prefill[d]} == prefill[d]
    assert not pa.wide_smem(torch.device("cpu"))


def test_wide_tiles_only_for_16_bit_queries_on_a_wide_gpu(monkeypatch) -> None:  # noqa: ANN001
    """use_wide_tiles: bf16 / fp16 queries on a device with the shared memory (a stand-in
    device here), not float32 ones (twice the tile's bytes), not the CPU interpreter, not a
    device without it."""
    monkeypatch.setattr(pa, "wide_smem", lambda device: device.type == "meta")
    for dtype, want in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False)):
        assert pa.use_wide_tiles(torch.empty(2, dtype=dtype, device="meta")) == want, dtype
    assert not pa.use_wide_tiles(torch.empty(2, dtype=torch.bfloat16))
    monkeypatch.setattr(pa, "wide_smem", lambda device: False)
    assert not pa.use_wide_tiles(torch.empty(2, dtype=torch.bfloat16, device="meta"))


def test_auto_splits_fill_the_sms(monkeypatch) -> None:
    """Batch-1 decode, 8 kv heads, 132 SMs: 32 splits at 30k, 64 at 131k (the H200 optimum);
    short contexts stay bounded by MIN_KEYS_PER_SPLIT; a full grid takes none."""
    monkeypatch.setattr(pa, "_num_sms", lambda index: 132)
    dev = torch.device("cuda", 0)
    assert pa._auto_kv_splits(8, 1, 30_000, dev) == 32
    assert pa._auto_kv_splits(8, 1, 131_072, dev) == 64
    assert pa._auto_kv_splits(8, 1, 4096, dev) == 4096 // pa.MIN_KEYS_PER_SPLIT
    assert pa._auto_kv_splits(8 * 64, 1, 131_072, dev) == 1
    assert pa._auto_kv_splits(8, 7, 131_072, dev) == 1


@pytest.mark.parametrize(
    "cfg,splits", [(WIDE, 16), (MID, 1), (None, 4)], ids=["wide", "mid", "table"]
)
def test_fp8_cache_fp16_dots(device, tolerances, monkeypatch, cfg, splits) -> None:
    """bf16 queries over an fp8 cache run their dots in fp16 (QUANT_F16_DOTS): the reference of
    the dequantized cache within bf16's tolerance, decode and a prefill chunk, and no further
    from it than the bf16-dot path (on the cache's own codes, with only rounding between them)."""
    batch = _batch([1, 5, 1], [600, 77, 33], 8, 2, 32, 16, torch.bfloat16, device, seed=9)
    kq, ks = quantize_kv(batch["k_cache"].float(), torch.float8_e4m3fn)
    vq, vs = quantize_kv(batch["v_cache"].float(), torch.float8_e4m3fn)
    batch = dict(batch, k_cache=kq, v_cache=vq)
    assert pa.quant_f16_dots(kq.dtype, batch["q"].dtype)
    assert not pa.quant_f16_dots(kq.dtype, torch.float32)  # float32 queries keep their dots
    assert not pa.quant_f16_dots(torch.int8, torch.bfloat16)  # int8 codes: not this path
    ref = _call(unified_attention_ref, batch, splits, None, k_scale=ks, v_scale=vs).float()
    f16 = _call(unified_attention, batch, splits, cfg, k_scale=ks, v_scale=vs).float()
    monkeypatch.setattr(pa, "QUANT_F16_DOTS", False)
    bf16 = _call(unified_attention, batch, splits, cfg, k_scale=ks, v_scale=vs).float()
    atol, rtol = tolerances[torch.bfloat16]
    torch.testing.assert_close(f16, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(bf16, ref, atol=atol, rtol=rtol)
    assert (f16 - ref).abs().max() <= (bf16 - ref).abs().max() * 1.5 + 1e-3
    assert not torch.equal(f16, bf16)  # the fp16 path did run (P rounds differently)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [1, 16, 32])
def test_gpu_fp8_cache_fp16_dots_8b_shape(tolerances, splits) -> None:
    """The 8B shape (32 q / 8 kv heads, head 128) over an fp8 cache at 16k / 9k context, bf16
    queries (fp16 dots), against the reference of the dequantized cache; the bf16 cache of the
    same values at 16+ splits takes the long-decode tiles."""
    dev = torch.device("cuda")
    batch = _batch([1, 1], [16384, 9000], 32, 8, 128, 16, torch.bfloat16, dev, seed=2)
    atol, rtol = tolerances[torch.bfloat16]
    out = _call(unified_attention, batch, splits, None)
    ref = _call(unified_attention_ref, batch, splits, None)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    kq, ks = quantize_kv(batch["k_cache"].float(), torch.float8_e4m3fn)
    vq, vs = quantize_kv(batch["v_cache"].float(), torch.float8_e4m3fn)
    qb = dict(batch, k_cache=kq, v_cache=vq)
    assert pa.quant_f16_dots(kq.dtype, batch["q"].dtype)
    out = _call(unified_attention, qb, splits, None, k_scale=ks, v_scale=vs)
    ref = _call(unified_attention_ref, qb, splits, None, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
