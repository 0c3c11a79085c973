"""unified_attention: hand-checked tiny cases, then a sweep against unified_attention_ref.

CPU runs use the Triton interpreter (conftest); bf16 works there because the wrapper upcasts bf16
dot operands under the interpreter (the interpreter's bf16 tl.dot is wrong). GPU-marked tests use
real shapes (D=128, 32 q / 8 kv heads, block 16, seq 2k).
"""

from __future__ import annotations

import math

import pytest
import torch

from xlaserve.kernels_cuda.paged_attention import unified_attention, unified_attention_ref

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _batch(
    q_lens: list[int],
    seq_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    page: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    extra_rows: int = 0,
) -> dict:
    """Random ragged batch with pages scattered over the cache (shuffled block ids)."""
    g = torch.Generator().manual_seed(seed)
    b = len(q_lens)
    max_blocks = max(math.ceil(s / page) for s in seq_lens)
    num_blocks = b * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)[: b * max_blocks]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    t = qsl[-1] + extra_rows

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return dict(
        q=rnd(t, hq, d),
        k_cache=rnd(num_blocks, page, hkv, d),
        v_cache=rnd(num_blocks, page, hkv, d),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=perm.reshape(b, max_blocks).to(torch.int32).to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        sm_scale=d**-0.5,
    )


def _run(
    fn, batch: dict, out=None, sliding_window=None, soft_cap=None, splits=None
) -> torch.Tensor:
    return fn(
        batch["q"], batch["k_cache"], batch["v_cache"], out, batch["query_start_loc"],
        batch["seq_lens"], batch["block_tables"], batch["max_query_len"], batch["max_seq_len"],
        batch["sm_scale"], sliding_window, soft_cap, num_kv_splits=splits,
    )  # fmt: skip


def _one_seq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page: int, device) -> dict:
    """q [q_len, Hq, D] as the last q_len positions of a context k/v [L, Hkv, D], identity pages."""
    length, hkv, d = k.shape
    nblk = math.ceil(length / page)
    kc = torch.zeros(nblk, page, hkv, d)
    vc = torch.zeros(nblk, page, hkv, d)
    kc.view(-1, hkv, d)[:length] = k
    vc.view(-1, hkv, d)[:length] = v
    return dict(
        q=q.to(device), k_cache=kc.to(device), v_cache=vc.to(device),
        query_start_loc=torch.tensor([0, q.shape[0]], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([length], dtype=torch.int32, device=device),
        block_tables=torch.arange(nblk, dtype=torch.int32, device=device)[None],
        max_query_len=q.shape[0], max_seq_len=length, sm_scale=1.0,
    )  # fmt: skip


# ---------------------------------------------------------------- tier 1: worked by hand


def test_single_key_returns_its_value_per_kv_head(device):
    # One key: softmax weight 1, so each q head returns V of ITS kv head (h // G), whatever q is.
    hq, hkv, d = 4, 2, 16
    q = torch.randn(1, hq, d)
    k = torch.randn(1, hkv, d)
    v = torch.stack([torch.full((d,), 1.0), torch.full((d,), -2.0)])[None]  # [1, Hkv, D]
    out = _run(unified_attention, _one_seq(q, k, v, page=4, device=device)).cpu()
    expected = torch.tensor([1.0, 1.0, -2.0, -2.0])[:, None].expand(hq, d)
    torch.testing.assert_close(out[0], expected)


def test_two_keys_softmax_weights(device):
    # q = e0, k0 = 0, k1 = 2 * e0 -> scores 0 and 2 (sm_scale 1): weights 1/(1+e^2), e^2/(1+e^2).
    d = 16
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    k = torch.zeros(2, 1, d)
    k[1, 0, 0] = 2.0
    v = torch.zeros(2, 1, d)
    v[0, 0, :] = 1.0
    v[1, 0, :] = 3.0
    out = _run(unified_attention, _one_seq(q, k, v, page=4, device=device)).cpu()
    w1 = math.exp(2) / (1 + math.exp(2))
    torch.testing.assert_close(out[0, 0], torch.full((d,), 1.0 * (1 - w1) + 3.0 * w1))


def test_causal_prefill_first_query_sees_only_first_key(device):
    # Prefill of 3 tokens: query 0 attends key 0 only -> exactly v0; query 2 averages all three
    # keys when all scores are equal (q = 0).
    d = 16
    q = torch.zeros(3, 1, d)
    k = torch.randn(3, 1, d)
    v = torch.arange(3, dtype=torch.float32)[:, None, None].expand(3, 1, d).clone()
    out = _run(unified_attention, _one_seq(q, k, v, page=2, device=device)).cpu()
    torch.testing.assert_close(out[0, 0], torch.zeros(d))
    torch.testing.assert_close(out[1, 0], torch.full((d,), 0.5))
    torch.testing.assert_close(out[2, 0], torch.full((d,), 1.0))


def test_sliding_window_one_sees_only_itself(device):
    # w = 1: key_pos > q_pos - 1 and key_pos <= q_pos -> only the query's own position.
    d = 16
    q = torch.randn(2, 1, d)  # last 2 positions (3, 4) of a 5-token context
    k = torch.randn(5, 1, d)
    v = torch.arange(5, dtype=torch.float32)[:, None, None].expand(5, 1, d).clone()
    out = _run(unified_attention, _one_seq(q, k, v, page=4, device=device), sliding_window=1).cpu()
    torch.testing.assert_close(out[:, 0], torch.tensor([[3.0], [4.0]]).expand(2, d))


def test_soft_cap_bounds_scores(device):
    # Raw scores 0 and 100 with cap 1 -> capped 0 and tanh(100) = 1: weights 1/(1+e), e/(1+e).
    d = 16
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 10.0
    k = torch.zeros(2, 1, d)
    k[1, 0, 0] = 10.0
    v = torch.zeros(2, 1, d)
    v[1] = 1.0
    out = _run(unified_attention, _one_seq(q, k, v, page=4, device=device), soft_cap=1.0).cpu()
    torch.testing.assert_close(out[0, 0], torch.full((d,), math.e / (1 + math.e)))


def test_padding_rows_of_out_untouched(device):
    batch = _batch([2, 1], [5, 3], 2, 1, 16, 4, torch.float32, device, extra_rows=3)
    out = torch.full_like(batch["q"], 7.0)
    _run(unified_attention, batch, out=out)
    ref = _run(unified_attention_ref, batch)
    torch.testing.assert_close(out[:3], ref[:3], atol=2e-5, rtol=1e-5)
    assert torch.all(out[3:] == 7.0)


def test_bad_arguments_raise(device):
    batch = _batch([1], [3], 2, 1, 16, 4, torch.float32, device)
    bad = dict(batch, query_start_loc=batch["query_start_loc"].long())
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        _run(unified_attention, bad)
    gqa = _batch([1], [3], 4, 2, 16, 4, torch.float32, device)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        _run(unified_attention, dict(gqa, q=torch.zeros(1, 3, 16, device=device)))
    with pytest.raises(ValueError, match="head_dim"):
        _run(unified_attention, dict(batch, q=torch.zeros(1, 2, 8, device=device)))
    with pytest.raises(ValueError, match="dtypes must match"):
        _run(unified_attention, dict(batch, q=batch["q"].half()))
    with pytest.raises(ValueError, match=r"\[B\+1\]"):
        _run(unified_attention, dict(batch, query_start_loc=batch["query_start_loc"][:1]))
    with pytest.raises(ValueError, match="sliding_window"):
        _run(unified_attention, batch, sliding_window=0)
    with pytest.raises(ValueError, match="num_kv_splits"):
        _run(unified_attention, batch, splits=3)
    with pytest.raises(ValueError, match="out shape"):
        _run(unified_attention, batch, out=torch.zeros(2, 2, 16, device=device))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    batch = _batch([1], [3], 2, 1, 16, 4, torch.float32, torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        _run(unified_attention, batch)


# ---------------------------------------------------------------- tier 2: sweep vs reference

# (q_lens, seq_lens, Hq, Hkv, D, page, dtype, sliding_window, soft_cap): mixed prefill chunks,
# full prefills, decodes, an empty sequence, non-power-of-2 GQA groups, partial last pages.
SWEEP = [
    ([5, 1, 1, 9], [12, 7, 1, 9], 4, 2, 64, 4, torch.float32, None, None),
    ([1, 1, 1], [17, 3, 30], 8, 1, 64, 8, torch.float16, None, None),
    ([6, 1, 0, 2], [6, 20, 4, 11], 6, 2, 128, 4, torch.float32, 4, None),
    ([3, 1], [19, 9], 4, 4, 128, 16, torch.bfloat16, None, 5.0),
    ([17, 1], [17, 25], 4, 2, 256, 8, torch.float16, 7, 3.0),
    ([2, 1, 4], [9, 13, 4], 2, 1, 96, 4, torch.bfloat16, 3, None),
]


@pytest.mark.parametrize(
    "case", SWEEP, ids=lambda c: f"q{c[0]}-s{c[1]}-{c[2]}x{c[3]}-d{c[4]}-{c[6]}"
)
def test_sweep_matches_reference(case, device, tolerances):
    q_lens, seq_lens, hq, hkv, d, page, dtype, window, cap = case
    batch = _batch(q_lens, seq_lens, hq, hkv, d, page, dtype, device, seed=len(q_lens) + d)
    out = _run(unified_attention, batch, sliding_window=window, soft_cap=cap)
    ref = _run(unified_attention_ref, batch, sliding_window=window, soft_cap=cap)
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "q_lens,seq_lens,window,splits",
    [
        ([1, 1, 1], [40, 3, 70], None, 4),  # decode; the 3-token sequence leaves splits empty
        ([4, 1], [37, 50], 9, 2),  # prefill chunk + decode, window: splits over a short range
    ],
)
def test_split_kv_matches_reference(q_lens, seq_lens, window, splits, device, tolerances):
    batch = _batch(q_lens, seq_lens, 4, 2, 64, 8, torch.float16, device, seed=splits, extra_rows=2)
    out = torch.full_like(batch["q"], 3.0)
    _run(unified_attention, batch, out=out, sliding_window=window, splits=splits)
    ref = _run(unified_attention_ref, batch, sliding_window=window)
    t = sum(q_lens)
    atol, rtol = tolerances[torch.float16]
    torch.testing.assert_close(out[:t].float(), ref[:t].float(), atol=atol, rtol=rtol)
    assert torch.all(out[t:] == 3.0)  # padding rows untouched by the merge kernel too


def test_int64_block_offsets_path(device, tolerances, monkeypatch):
    """The int64 block-offset variant (taken by caches past 2^31 elements; forced here on a
    small one) matches the reference, prefill and decode, float and fp8 codes."""
    from xlaserve.kernels_cuda import paged_attention
    from xlaserve.kernels_cuda.kv_quant import quantize_kv

    monkeypatch.setattr(paged_attention, "OFFS64_MIN_ELEMENTS", 1)
    batch = _batch([9, 1], [30, 21], 4, 2, 32, 4, torch.float32, device, seed=11)
    out = _run(unified_attention, batch, splits=2)
    ref = _run(unified_attention_ref, batch)
    atol, rtol = tolerances[torch.float32]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    kq, ks = quantize_kv(batch["k_cache"], torch.float8_e4m3fn)
    vq, vs = quantize_kv(batch["v_cache"], torch.float8_e4m3fn)
    args = (batch["q"], kq, vq, None, batch["query_start_loc"], batch["seq_lens"],
            batch["block_tables"], batch["max_query_len"], batch["max_seq_len"],
            batch["sm_scale"])  # fmt: skip
    out = unified_attention(*args, k_scale=ks, v_scale=vs)
    ref = unified_attention_ref(*args, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("fast", [True, False], ids=["fast_causal", "plain"])
@pytest.mark.parametrize(
    "cap,splits,dtype",
    [(None, None, torch.float32), (7.0, None, torch.float32), (None, 4, torch.float16)],
)
def test_long_prefill_chunk_over_cached_prefix(
    fast, cap, splits, dtype, device, tolerances, monkeypatch
):
    """Prefill chunks far past the start of their context (many key tiles wholly before every
    query of a tile: the unmasked loop of the causal fast path) next to a decode and a fresh
    prompt, with the fast path (tiles last-first, mask on the diagonal tiles only) and without."""
    from xlaserve.kernels_cuda import paged_attention

    monkeypatch.setattr(paged_attention, "CAUSAL_FAST_PATH", fast)
    batch = _batch([24, 1, 9], [70, 45, 9], 8, 2, 64, 8, dtype, device, seed=3)
    out = _run(unified_attention, batch, soft_cap=cap, splits=splits)
    ref = _run(unified_attention_ref, batch, soft_cap=cap)
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,cap", [(None, None), (512, None), (None, 50.0)])
def test_gpu_real_shapes_mixed_batch(dtype, window, cap, tolerances):
    # 6 decodes at ~2k context, one 512-token chunk continuing a 2k prompt, one fresh prefill.
    q_lens = [1] * 6 + [512, 256]
    seq_lens = [2048, 2000, 1537, 31, 2048, 999, 2048, 256]
    batch = _batch(q_lens, seq_lens, 32, 8, 128, 16, dtype, torch.device("cuda"), seed=3)
    out = _run(unified_attention, batch, sliding_window=window, soft_cap=cap)
    ref = _run(unified_attention_ref, batch, sliding_window=window, soft_cap=cap)
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [64, 256])
def test_gpu_head_dims_decode_and_prefill(d, tolerances):
    batch = _batch([1, 1, 1, 300], [2048, 700, 5, 300], 16, 4, d, 16, torch.bfloat16,
                   torch.device("cuda"), seed=d)  # fmt: skip
    out = _run(unified_attention, batch)
    ref = _run(unified_attention_ref, batch)
    atol, rtol = tolerances[torch.bfloat16]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_gpu_long_decode_split_kv(splits, tolerances):
    # Batch 2 x 8 kv heads at 16k context: None lets the heuristic split (few programs, long keys).
    batch = _batch([1, 1], [16384, 9000], 32, 8, 128, 16, torch.bfloat16, torch.device("cuda"))
    out = _run(unified_attention, batch, splits=splits)
    ref = _run(unified_attention_ref, batch)
    atol, rtol = tolerances[torch.bfloat16]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("q_len", [1, 37])
def test_gpu_cache_past_2_31_elements(q_len, tolerances):
    # An fp8 layer cache of more than 2^31 elements (a small model's KV on a large GPU): the
    # sequence's blocks sit at the end, where element offsets need 64 bits. The same codes in a
    # compact cache are the reference.
    from xlaserve.kernels_cuda.kv_quant import quantize_kv

    dev, fp8 = torch.device("cuda"), torch.float8_e4m3fn
    hq, hkv, d, page, used = 32, 8, 128, 16, 40
    n_big = (1 << 31) // (page * hkv * d) + 64
    g = torch.Generator().manual_seed(0)
    kq, ks = quantize_kv(torch.randn(used, page, hkv, d, generator=g).to(dev), fp8)
    vq, vs = quantize_kv(torch.randn(used, page, hkv, d, generator=g).to(dev), fp8)
    kc = torch.empty(n_big, page, hkv, d, dtype=fp8, device=dev)
    vc = torch.empty_like(kc)
    ksc = torch.ones(n_big, page, hkv, device=dev)
    vsc = torch.ones_like(ksc)
    ids = torch.arange(n_big - used, n_big, device=dev)
    # Through uint8 views: index_put has no float8 kernel in every torch build.
    kc.view(torch.uint8)[ids] = kq.view(torch.uint8)
    vc.view(torch.uint8)[ids] = vq.view(torch.uint8)
    ksc[ids], vsc[ids] = ks, vs
    ctx = used * page - 3
    q = torch.randn(q_len, hq, d, generator=g).to(dev, torch.bfloat16)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
    sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
    big = unified_attention(q, kc, vc, None, qsl, sl, ids.to(torch.int32)[None], q_len, ctx,
                            d**-0.5, k_scale=ksc, v_scale=vsc)  # fmt: skip
    table = torch.arange(used, dtype=torch.int32, device=dev)[None]
    ref = unified_attention_ref(q, kq, vq, None, qsl, sl, table, q_len, ctx, d**-0.5,
                                k_scale=ks, v_scale=vs)  # fmt: skip
    atol, rtol = tolerances[torch.bfloat16]
    torch.testing.assert_close(big.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@gpu
def test_gpu_decode_cuda_graph_replay(tolerances):
    # Capture a decode step once, then replay with new seq_lens/queries in the same buffers.
    # As the engine captures: block tables and max_seq_len sized for the longest replay; the
    # capture sees short sequences, the replay longer ones in the same buffers.
    dev = torch.device("cuda")
    batch = _batch([1] * 8, [1700 - 150 * i for i in range(8)], 32, 8, 128, 16, torch.bfloat16,
                   dev, seed=1)  # fmt: skip
    batch["seq_lens"].copy_(torch.tensor([100 + 200 * i for i in range(8)], dtype=torch.int32))
    out = torch.empty_like(batch["q"])
    _run(unified_attention, batch, out=out, splits=4)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(unified_attention, batch, out=out, splits=4)
    batch["seq_lens"].copy_(torch.tensor([1700 - 150 * i for i in range(8)], dtype=torch.int32))
    batch["q"].copy_(torch.randn_like(batch["q"]))
    graph.replay()
    torch.cuda.synchronize()
    ref = _run(unified_attention_ref, batch)
    atol, rtol = tolerances[torch.bfloat16]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
