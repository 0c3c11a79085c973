"""Long prefill chunks through torch SDPA over the paged cache (kernels_cuda/prefill_sdpa.py),
the rest of the step through the Triton kernel (interpreted on the CPU), against the float32
reference `unified_attention_ref`; the exact split of a mixed batch; the switch's gating."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import _batch

from xlaserve.backends_torch.attention_triton import TritonAttention
from xlaserve.config import KernelConfig
from xlaserve.kernels_cuda.kv_quant import quantize_kv
from xlaserve.kernels_cuda.paged_attention import unified_attention_ref
from xlaserve.kernels_cuda.prefill_sdpa import plan_sdpa_split

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ON = KernelConfig(prefill_sdpa="on", prefill_sdpa_min_tokens=16, pdl=False)


def _step(
    q_lens: list[int],
    seq_lens: list[int],
    hq: int = 4,
    hkv: int = 2,
    d: int = 32,
    page: int = 8,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    extra_rows: int = 0,
    seed: int = 0,
) -> tuple[dict, object]:
    """test_paged_attention's random ragged batch (shuffled pages) and the step's metadata as
    TritonAttention builds it."""
    x = _batch(q_lens, seq_lens, hq, hkv, d, page, dtype, torch.device(device), seed, extra_rows)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    md = TritonAttention().build_metadata(
        query_start_loc=x["query_start_loc"],
        seq_lens=x["seq_lens"],
        block_tables=x["block_tables"],
        slot_mapping=torch.zeros(x["q"].shape[0], dtype=torch.int64, device=device),  # unused
        max_query_len=x["max_query_len"],
        max_seq_len=x["max_seq_len"],
        query_start_loc_host=qsl,
        seq_lens_host=seq_lens,
    )
    return x, md


def _ref(x: dict, md, scale: float, **kw) -> torch.Tensor:
    return unified_attention_ref(
        x["q"], x["k_cache"], x["v_cache"], None, md.query_start_loc, md.seq_lens,
        md.block_tables, md.max_query_len, md.max_seq_len, scale, **kw,
    )  # fmt: skip


def test_plan_splits_a_mixed_batch_exactly() -> None:
    # decode, fresh 20-token prompt, empty row, 5-token chunk, 16-token chunk over a 30-token prefix
    x, md = _step([1, 20, 0, 5, 16], [40, 20, 3, 12, 46], extra_rows=3)
    split = plan_sdpa_split(md, 16)
    assert split.long == ((1, 1, 21, 20), (4, 26, 42, 46))
    assert split.num_tokens == 42
    rest = split.rest
    assert rest.rows.tolist() == [0, 21, 22, 23, 24, 25]
    assert rest.query_start_loc.tolist() == [0, 1, 6]
    assert rest.seq_lens.tolist() == [40, 12]
    assert torch.equal(rest.block_tables, md.block_tables[[0, 3]])
    assert (rest.max_query_len, rest.max_seq_len) == (5, 40)
    assert plan_sdpa_split(md, 21) is None  # no chunk that long: one Triton launch
    only_long = plan_sdpa_split(_step([20, 17], [20, 30])[1], 16)
    assert only_long.rest is None and len(only_long.long) == 2


@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [
        ([1, 20, 5, 16, 1], [40, 20, 12, 46, 7]),  # mixed: decodes, short and long chunks
        ([33], [33]),  # one fresh prompt, nothing else
        ([24, 18], [61, 18]),  # every sequence long, one over a cached prefix
    ],
)
def test_sdpa_split_matches_reference(q_lens: list[int], seq_lens: list[int]) -> None:
    x, md = _step(q_lens, seq_lens, extra_rows=2, seed=len(q_lens))
    be = TritonAttention()
    be.kernels = ON
    out = be.forward(x["q"], x["k_cache"], x["v_cache"], md, 0.2)
    assert ("prefill_sdpa", 16) in md.derived  # the SDPA path ran
    torch.testing.assert_close(out, _ref(x, md, 0.2), atol=2e-5, rtol=1e-5)
    assert not out[sum(q_lens) :].any()  # padding rows are zeros


def test_chunk_over_prefix_as_padded_square(monkeypatch) -> None:  # noqa: ANN001
    """The padded square call (taken on CUDA where it is cheaper) gives the bottom-right causal
    result: forced on here, chunks over cached prefixes of several lengths match the reference."""
    from xlaserve.kernels_cuda import prefill_sdpa as ps

    taken: list[tuple[int, int]] = []
    monkeypatch.setattr(ps, "pad_to_square", lambda q, kv, cuda: taken.append((q, kv)) or True)
    x, md = _step([24, 18, 1], [61, 40, 9], extra_rows=2, seed=11)
    be = TritonAttention()
    be.kernels = ON
    out = be.forward(x["q"], x["k_cache"], x["v_cache"], md, 0.2)
    assert sorted(taken) == [(18, 40), (24, 61)]
    torch.testing.assert_close(out, _ref(x, md, 0.2), atol=2e-5, rtol=1e-5)


def test_chunk_over_prefix_split_by_lse(monkeypatch) -> None:  # noqa: ANN001
    """The split route (CUDA's default for a chunk over a cached prefix): prefix keys without a
    mask and the chunk's own block causal, merged by log-sum-exp (plain torch on the CPU, the
    same merge as on CUDA), gives the bottom-right causal result, GQA included; a fresh prompt
    stays one causal call."""
    from xlaserve.kernels_cuda import prefill_sdpa as ps

    routes: list[tuple[int, int, str]] = []
    inner = ps.chunk_route

    def route(q: int, kv: int, cuda: bool, cudnn: bool = True) -> str:
        r = "split" if q < kv else inner(q, kv, cuda, cudnn)
        routes.append((q, kv, r))
        return r

    monkeypatch.setattr(ps, "chunk_route", route)
    x, md = _step([24, 18, 1, 20], [61, 40, 9, 20], hq=8, hkv=2, extra_rows=2, seed=12)
    be = TritonAttention()
    be.kernels = ON
    out = be.forward(x["q"], x["k_cache"], x["v_cache"], md, 0.2)
    assert sorted(routes) == [(18, 40, "split"), (20, 20, "causal"), (24, 61, "split")]
    torch.testing.assert_close(out, _ref(x, md, 0.2), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h, d", [(5, 48), (8, 32)])
def test_merge_lse_matches_torch(dtype: torch.dtype, h: int, d: int) -> None:
    """The fused merge (Triton; interpreted on the CPU) against the float32 torch formula:
    heads not a multiple of its head block, a head size not a power of 2, o1 in [1, H, Lq, D]
    memory and o2 in [1, Lq, H, D] memory (cuDNN's outputs may be either), out [Lq, H, D]."""
    from xlaserve.kernels_cuda.prefill_sdpa import merge_lse

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    lq = 7
    o1 = torch.randn(1, h, lq, d, generator=g).to(dev, dtype)
    o2 = torch.randn(1, lq, h, d, generator=g).to(dev, dtype).transpose(1, 2)
    l1 = (3 * torch.randn(1, h, lq, generator=g)).to(dev)
    l2 = (3 * torch.randn(1, h, lq, generator=g)).to(dev)
    out = torch.empty(lq, h, d, dtype=dtype, device=dev)
    merge_lse(o1, l1, o2, l2, out)
    lse = torch.logaddexp(l1, l2)[..., None]
    want = o1.float() * torch.exp(l1[..., None] - lse) + o2.float() * torch.exp(l2[..., None] - lse)
    tol = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2)}[dtype]
    torch.testing.assert_close(out.float(), want[0].transpose(0, 1), atol=tol[0], rtol=tol[1])


@pytest.mark.gpu
@gpu
def test_gpu_split_attention_real_shape() -> None:
    """The engine's split route at the 30k prompt's second-chunk proportions (shrunk: 1,362
    queries over 3,000 keys, 32 / 8 heads, D 128, bf16): cuDNN's two calls with native GQA and
    the fused merge against the float32 bottom-right causal reference."""
    from xlaserve.kernels_cuda.prefill_sdpa import split_attention

    g = torch.Generator().manual_seed(7)
    lq, lk, hq, hkv, d = 1362, 3000, 32, 8, 128
    q = torch.randn(lq, hq, d, generator=g).cuda().bfloat16()
    k, v = (torch.randn(lk, hkv, d, generator=g).cuda().bfloat16() for _ in range(2))
    out = torch.empty_like(q)
    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    split_attention(qb, kb, vb, d**-0.5, out)
    kr, vr = (x.float().repeat_interleave(hq // hkv, dim=1) for x in (kb, vb))
    s = torch.matmul(qb.float(), kr.transpose(-1, -2)) * d**-0.5
    mask = torch.ones(lq, lk, dtype=torch.bool, device="cuda").triu_(lk - lq + 1)
    want = torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ vr
    torch.testing.assert_close(out.float(), want[0].transpose(0, 1), atol=3e-2, rtol=2e-2)


def test_chunk_route_rule(monkeypatch) -> None:  # noqa: ANN001
    """A fresh prompt is one causal call; a chunk over a prefix splits on CUDA (CHUNK_ROUTE
    "split"), with "pad" pads where pad_to_square says, and takes the bottom-right causal call
    on the CPU."""
    from xlaserve.kernels_cuda import prefill_sdpa as ps

    assert ps.chunk_route(30000, 30000, True) == "causal"
    assert ps.chunk_route(13616, 30000, True) == "split"
    assert ps.chunk_route(13616, 30000, False) == "lower_right"
    assert ps.chunk_route(13616, 30000, True, cudnn=False) == "pad"  # e.g. ROCm, pre-sm80
    monkeypatch.setattr(ps, "CHUNK_ROUTE", "pad")
    assert ps.chunk_route(13616, 30000, True) == "pad"
    assert ps.chunk_route(2048, 128000, True) == "lower_right"


def test_split_supported_rule(monkeypatch) -> None:  # noqa: ANN001
    """The split route's cuDNN limits: 16-bit queries, head size a multiple of 8 up to 128
    (256 from sm_90), a device where cuDNN's fused attention runs (never the CPU)."""
    from xlaserve.kernels_cuda import prefill_sdpa as ps

    assert not ps.split_supported(torch.device("cpu"), torch.bfloat16, 128)
    gpu = torch.device("cuda", 0)
    cap = {"v": (9, 0)}
    monkeypatch.setattr(ps, "cudnn_attention_ok", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["v"])
    assert ps.split_supported(gpu, torch.bfloat16, 128)
    assert ps.split_supported(gpu, torch.float16, 256)
    assert not ps.split_supported(gpu, torch.float32, 128)
    assert not ps.split_supported(gpu, torch.bfloat16, 100)
    assert not ps.split_supported(gpu, torch.bfloat16, 264)
    cap["v"] = (8, 0)
    assert ps.split_supported(gpu, torch.bfloat16, 128)
    assert not ps.split_supported(gpu, torch.bfloat16, 256)


def test_pad_to_square_rule() -> None:
    """Padding where the square call's pairs at SQUARE_SPEEDUP cost less than the chunk's own:
    the 30k prompt's second chunk pads, a short chunk over a long prefix does not, never on the
    CPU or for a fresh prompt."""
    from xlaserve.kernels_cuda.prefill_sdpa import pad_to_square

    assert pad_to_square(13616, 30000, True)
    assert not pad_to_square(2048, 128000, True)
    assert not pad_to_square(13616, 30000, False)
    assert not pad_to_square(30000, 30000, True)
    assert pad_to_square(900, 1000, True) and not pad_to_square(100, 1000, True)


def test_quantized_cache_dequantized_by_the_gather() -> None:
    x, md = _step([1, 20, 3], [30, 26, 9], seed=5)
    scales = {}
    for name in ("k_cache", "v_cache"):
        codes, s = quantize_kv(x[name], torch.int8)
        x[name], scales[name] = codes, s
    be = TritonAttention()
    be.kernels = ON
    out = be.forward(
        x["q"], x["k_cache"], x["v_cache"], md, 0.2,
        k_scale=scales["k_cache"], v_scale=scales["v_cache"],
    )  # fmt: skip
    ref = unified_attention_ref(
        x["q"], x["k_cache"], x["v_cache"], None, md.query_start_loc, md.seq_lens,
        md.block_tables, md.max_query_len, md.max_seq_len, 0.2,
        k_scale=scales["k_cache"], v_scale=scales["v_cache"],
    )  # fmt: skip
    assert ("prefill_sdpa", 16) in md.derived
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kernels,layer,takes_sdpa",
    [
        (ON, {}, True),
        (KernelConfig(prefill_sdpa="off", prefill_sdpa_min_tokens=16), {}, False),
        (KernelConfig(prefill_sdpa="auto", prefill_sdpa_min_tokens=16), {}, False),  # CPU
        (ON, {"sliding_window": 6}, False),
        (ON, {"logit_softcap": 5.0}, False),
        (ON, {"chunk_size": 8}, False),
    ],
)
def test_switch_and_layers_that_keep_triton(kernels, layer: dict, takes_sdpa: bool) -> None:
    x, md = _step([1, 20], [30, 20], seed=7)
    be = TritonAttention()
    be.kernels = kernels
    out = be.forward(x["q"], x["k_cache"], x["v_cache"], md, 0.2, **layer)
    assert (("prefill_sdpa", 16) in md.derived) == takes_sdpa
    ref_kw = {"soft_cap" if k == "logit_softcap" else k: v for k, v in layer.items()}
    torch.testing.assert_close(out, _ref(x, md, 0.2, **ref_kw), atol=2e-5, rtol=1e-5)


def test_min_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="prefill_sdpa_min_tokens"):
        KernelConfig(prefill_sdpa_min_tokens=0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_real_shapes_flash(dtype: torch.dtype) -> None:
    """32 q / 8 kv heads, D=128, 16-token pages: a fresh 3k prompt on the flash kernel (GQA
    without repeating K / V), a 2k chunk over a 3k prefix through the split route (two cuDNN
    calls merged by log-sum-exp: the private op ignores the forced backend) and decodes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x, md = _step([3000, 1, 2048, 1], [3000, 4000, 5048, 77], 32, 8, 128, 16, dtype, "cuda")
    be = TritonAttention()
    be.kernels = KernelConfig(prefill_sdpa="on", prefill_sdpa_min_tokens=1024)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # fail rather than fall back to another kernel
        out = be.forward(x["q"], x["k_cache"], x["v_cache"], md, 128**-0.5)
    assert ("prefill_sdpa", 1024) in md.derived
    torch.testing.assert_close(
        out.float(), _ref(x, md, 128**-0.5).float(), atol=3e-2 if dtype == torch.bfloat16 else 4e-3,
        rtol=2e-2 if dtype == torch.bfloat16 else 4e-3,
    )  # fmt: skip


def test_max_padded_len_is_the_longest_padded_context() -> None:
    """Against a search over every (chunk, context) pair: the longest context any chunk of at
    most T queries pads (0 when none does), capped by max_len."""
    from xlaserve.kernels_cuda.prefill_sdpa import max_padded_len, pad_to_square

    for t, max_len in [(40, 200), (40, 90), (7, 30), (1, 50), (64, 64)]:
        want = max(
            (
                kv
                for q in range(1, t + 1)
                for kv in range(1, max_len + 1)
                if pad_to_square(q, kv, True)
            ),
            default=0,
        )
        assert max_padded_len(t, max_len) == want, (t, max_len)


@pytest.mark.parametrize("chunk_route, cudnn", [("split", True), ("pad", True), ("split", False)])
@pytest.mark.parametrize("max_chunk, max_len", [(64, 200), (96, 96), (200, 64)])
def test_transient_bytes_bound_every_call(
    monkeypatch,  # noqa: ANN001
    chunk_route: str,
    cudnn: bool,
    max_chunk: int,
    max_len: int,
) -> None:
    """transient_bytes bounds call_bytes of every chunk the engine can send on CUDA: q <=
    max_chunk queries ending a context of kv <= max_len, by the route chunk_route takes (under
    either CHUNK_ROUTE, with and without cuDNN), and is reached by one of them (it is the max,
    not a looser figure)."""
    from xlaserve.kernels_cuda import prefill_sdpa as ps

    monkeypatch.setattr(ps, "CHUNK_ROUTE", chunk_route)
    for quant in (False, True):
        shape = (8, 2, 16, 2, quant)
        bound = ps.transient_bytes(max_chunk, max_len, *shape, cudnn=cudnn)
        calls = [
            ps.call_bytes(q, kv, *shape, route=ps.chunk_route(q, kv, True, cudnn))
            for kv in range(1, max_len + 1)
            for q in range(1, min(max_chunk, kv) + 1)
        ]
        assert max(calls) == bound, (max(calls), bound)


def test_sdpa_reserve_follows_the_switch() -> None:
    """The KV profiling reserve (memory.sdpa_reserve): 0 with the path off (or auto on the CPU,
    or another attention backend); with it on, transient_bytes of the runner's shapes, which
    grows with max_model_len (the gathered context) and counts a quantized cache's gather."""
    from types import SimpleNamespace

    from xlaserve.backends_torch.memory import sdpa_reserve
    from xlaserve.kernels_cuda.prefill_sdpa import transient_bytes

    def runner(  # noqa: ANN202
        mode: str,
        backend: str = "triton",
        max_len: int = 32768,
        codes=None,
        step: int = 8192,  # noqa: ANN001
    ):
        return SimpleNamespace(
            kernels=KernelConfig(prefill_sdpa=mode), device=torch.device("cpu"),
            attn_backend_name=backend, dtype=torch.bfloat16, kv_code_dtype=codes,
            spec=SimpleNamespace(num_heads=32, num_kv_heads=8, head_dim=128),
            config=SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=step)),
            max_model_len=max_len,
        )  # fmt: skip

    assert sdpa_reserve(runner("off")) == 0
    assert sdpa_reserve(runner("auto")) == 0  # auto takes SDPA on CUDA only
    assert sdpa_reserve(runner("on", backend="torch_sdpa")) == 0
    on = sdpa_reserve(runner("on"))
    # (the stand-in runner is on the CPU: no cuDNN, the reserve of the routes it would take)
    assert on == transient_bytes(8192, 32768, 32, 8, 128, 2, False, cudnn=False) > 0
    assert (
        sdpa_reserve(runner("on", max_len=131072)) >= on > sdpa_reserve(runner("on", max_len=8192))
    )
    assert sdpa_reserve(runner("on", step=4095)) == 0  # no chunk reaches min_tokens (4096)
    assert sdpa_reserve(runner("on", codes=torch.float8_e4m3fn)) > on


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("q_len, kv_len", [(2048, 2048), (3000, 5000), (1024, 12000)])
def test_gpu_transient_bytes_bound_the_peak(q_len: int, kv_len: int) -> None:
    """What sdpa_prefill allocates on top of its inputs stays within call_bytes of its shape,
    which transient_bytes (the KV profiling reserve) bounds, and is most of it: a fresh prompt,
    chunks over a prefix (split by lse: the repeated K / V and the merge dominate).
    H100, 2026-12-05, before the split route (padded / bottom right): 25,167,360 / 104,400,384
    / 58,164,224 bytes used."""
    from xlaserve.kernels_cuda.prefill_sdpa import (
        call_bytes,
        chunk_route,
        sdpa_prefill,
        transient_bytes,
    )

    x, md = _step([q_len], [kv_len], 32, 8, 128, 16, torch.bfloat16, "cuda")
    out = torch.empty_like(x["q"])
    long = ((0, 0, q_len, kv_len),)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sdpa_prefill(x["q"], x["k_cache"], x["v_cache"], md.block_tables, long, 128**-0.5, out)
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - base
    route = chunk_route(q_len, kv_len, True)
    own = call_bytes(q_len, kv_len, 32, 8, 128, 2, False, route)
    assert used <= own <= transient_bytes(q_len, kv_len, 32, 8, 128, 2, False), (used, own)
    assert used >= 0.8 * own, (used, own, route)
