"""Quantized KV cache (kv_cache_dtype "int8" / "fp8") on the torch backend.

Contract: xlaserve.quantization.kv_quant (per (token, KV head) float32 scale, int8 /
float8_e4m3fn codes, layer cache (k_q, v_q, k_scale, v_scale)). Checked here:
- the torch quantizer and the Triton write kernel (interpreter) give the numpy reference's codes
  and scales bit for bit, int8 and fp8 (the interpreter's own fp32 -> fp8 cast is not round to
  nearest, so the kernel rounds to the e4m3 grid itself; it is exact here);
- write + attention of every torch backend (torch_ref, torch_batched, triton incl. split-KV) on
  a ragged GQA batch of decodes and prefill chunks vs numpy float attention over the
  numpy-dequantized cache;
- a tiny random Llama end to end: logits and greedy tokens vs the float cache;
- KV capacity: blocks from the same cpu_kv_cache_bytes grow by exactly 2 * D * elem / (D + 4);
- host-tier offload round trip with the int8 cache; MLA models use the quantized cache too.

Measured (trained demo model, held-out Genesis 50:1-4, 148 tokens, one prefill whose attention
reads the quantized cache): perplexity float 18.5754, int8 KV 18.5604 (-0.08%), fp8 KV 18.4953
(-0.43%); logits rel. error int8 0.0023, fp8 0.0096; top-1 agreement int8 1.000, fp8 0.966.
Bounds: perplexity within 1% (int8) / 3% (fp8) of float, rel <= 0.006 / 0.025, top-1 >= 0.98 /
0.93. Tiny random Llama (std 0.15 init, flat logits, peaky attention: a harsher case): rel int8
0.011, fp8 0.064; top-1 0.975 / 0.825; greedy tokens of int8 equal float's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from optional_deps import import_or_skip

torch = import_or_skip("torch")

from quant_testlib import perplexity, runner_logits  # noqa: E402

from xlaserve.backends_torch.layers.attention import (  # noqa: E402
    AttentionMetadata,
    get_attention_backend,
)
from xlaserve.kernels_cuda.kv_quant import KV_CODE_DTYPES, dequantize_kv, quantize_kv  # noqa: E402
from xlaserve.quantization.kv_quant import dequantize_kv_ref, quantize_kv_ref  # noqa: E402

KV_DTYPES = ("int8", "fp8")


def _sample(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random K/V-like rows over several magnitudes, one all-zero row (scale 1)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.exp(rng.uniform(-6, 3, shape[:-1])).astype(np.float32)[..., None]
    x.reshape(-1, shape[-1])[0] = 0.0
    return x


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_torch_quantizer_matches_numpy_reference(kv: str) -> None:
    x = _sample((64, 3, 16), 0)
    q_ref, s_ref = quantize_kv_ref(x, kv)
    q, s = quantize_kv(torch.from_numpy(x), KV_CODE_DTYPES[kv])
    assert q.dtype == KV_CODE_DTYPES[kv] and s.dtype == torch.float32
    np.testing.assert_array_equal(q.float().numpy(), q_ref.astype(np.float32))
    np.testing.assert_array_equal(s.numpy(), s_ref)
    assert s_ref.reshape(-1)[0] == 1.0
    np.testing.assert_array_equal(dequantize_kv(q, s).numpy(), dequantize_kv_ref(q_ref, s_ref))
    # The rounding error is half a step of the code grid (times the scale), no more.
    err = np.abs(dequantize_kv_ref(q_ref, s_ref) - x)
    sc = s_ref[..., None]
    if kv == "int8":
        bound = 0.5 * sc
    else:  # half an e4m3 ulp: <= 2^-4 relative; subnormals: half the 2^-9 step
        bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * sc)
    assert (err <= bound * (1 + 1e-5)).all()
    assert err.max() > 0


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_triton_write_kv_quantizes_like_reference(kv: str) -> None:
    from xlaserve.kernels_cuda.kv_write import write_kv, write_kv_ref

    n, s, h, d, t = 5, 4, 3, 16, 9
    k = torch.from_numpy(_sample((t, h, d), 1))
    v = torch.from_numpy(_sample((t, h, d), 2))
    slots = torch.tensor([7, -1, 0, 19, 3, 12, -1, 8, 1], dtype=torch.int32)
    code = KV_CODE_DTYPES[kv]
    outs = []
    for fn in (write_kv, write_kv_ref):
        kc, vc = torch.zeros(n, s, h, d, dtype=code), torch.zeros(n, s, h, d, dtype=code)
        ks, vs = torch.full((n, s, h), -1.0), torch.full((n, s, h), -1.0)
        fn(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
        outs.append((kc, vc, ks, vs))
    keep = slots >= 0
    for x, i in ((k, 0), (v, 1)):
        q_ref, s_ref = quantize_kv_ref(x[keep].numpy(), kv)
        for kc_, vc_, ks_, vs_ in outs:
            codes, scales = (kc_, ks_) if i == 0 else (vc_, vs_)
            flat = slots[keep].long()
            np.testing.assert_array_equal(
                codes.view(n * s, h, d)[flat].float().numpy(), q_ref.astype(np.float32)
            )
            np.testing.assert_array_equal(scales.view(n * s, h)[flat].numpy(), s_ref)
            untouched = torch.ones(n * s, dtype=torch.bool)
            untouched[flat] = False
            assert bool((scales.view(n * s, h)[untouched] == -1.0).all())
    with pytest.raises(ValueError, match="k_scale / v_scale needed"):
        write_kv(k, v, outs[0][0], outs[0][1], slots)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        write_kv(k, v, outs[0][0], outs[0][1], slots, k_scale=outs[0][2][:2], v_scale=outs[0][3])


# A ragged batch: decodes with context, a first prefill, prefill chunks after cached context.
Q_LENS = [1, 6, 1, 7, 3]
SEQ_LENS = [9, 6, 37, 12, 20]
HQ, HKV, D, PAGE = 4, 2, 16, 4


def _np_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """q [Lq, Hq, D] as the last Lq positions of k/v [L, Hkv, D]; causal, GQA; float64 math."""
    lq, length = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    kk = np.repeat(k, g, axis=1).astype(np.float64)
    vv = np.repeat(v, g, axis=1).astype(np.float64)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), kk) * scale
    qpos = np.arange(length - lq, length)[:, None]
    s = np.where(np.arange(length)[None, :] <= qpos, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vv).astype(np.float32)


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("backend", ["torch_ref", "torch_batched", "triton", "triton_split"])
def test_attention_backends_vs_dequantized_reference(backend: str, kv: str) -> None:
    name = "triton" if backend.startswith("triton") else backend
    be = get_attention_backend(name)
    rng = np.random.default_rng(3)
    b = len(Q_LENS)
    nblk = [math.ceil(s / PAGE) for s in SEQ_LENS]
    num_blocks = sum(nblk) + 2
    perm = rng.permutation(num_blocks)[: sum(nblk)]
    tables = np.zeros((b, max(nblk)), dtype=np.int32)
    o = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[o : o + n]
        o += n
    ctx_k = [_sample((s, HKV, D), 10 + i) for i, s in enumerate(SEQ_LENS)]
    ctx_v = [_sample((s, HKV, D), 20 + i) for i, s in enumerate(SEQ_LENS)]
    q = rng.standard_normal((sum(Q_LENS), HQ, D)).astype(np.float32)

    def slots_of(i: int, lo: int, hi: int) -> list[int]:
        return [int(tables[i, p // PAGE]) * PAGE + p % PAGE for p in range(lo, hi)]

    code = KV_CODE_DTYPES[kv]
    kc = torch.zeros(num_blocks, PAGE, HKV, D, dtype=code)
    vc = torch.zeros_like(kc)
    ks, vs = torch.ones(num_blocks, PAGE, HKV), torch.ones(num_blocks, PAGE, HKV)
    # Earlier steps' context, then this step's new tokens, both through the backend's write.
    old = [(i, 0, s - ql) for i, (s, ql) in enumerate(zip(SEQ_LENS, Q_LENS, strict=True))]
    new = [(i, s - ql, s) for i, (s, ql) in enumerate(zip(SEQ_LENS, Q_LENS, strict=True))]
    for part in (old, new):
        kk = np.concatenate([ctx_k[i][lo:hi] for i, lo, hi in part])
        vv = np.concatenate([ctx_v[i][lo:hi] for i, lo, hi in part])
        sl = sum((slots_of(i, lo, hi) for i, lo, hi in part), [])
        if part is new:
            sl = sl + [-1]  # a padding token: never written
            kk = np.concatenate([kk, np.full((1, HKV, D), 9.0, np.float32)])
            vv = np.concatenate([vv, np.full((1, HKV, D), 9.0, np.float32)])
        slot_t = torch.tensor(sl, dtype=torch.int32 if name == "triton" else torch.long)
        be.write_kv(
            torch.from_numpy(kk), torch.from_numpy(vv), kc, vc, slot_t, k_scale=ks, v_scale=vs
        )
    qsl = [0, *np.cumsum(Q_LENS).tolist()]
    md_cls = AttentionMetadata
    extra = {}
    if name == "triton":
        from xlaserve.backends_torch.attention_triton import TritonAttentionMetadata

        md_cls = TritonAttentionMetadata
        extra = {"num_kv_splits": 4 if backend == "triton_split" else 1}
    md = md_cls(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32),
        block_tables=torch.from_numpy(tables),
        slot_mapping=torch.tensor(sum((slots_of(*x) for x in new), []), dtype=torch.long),
        max_query_len=max(Q_LENS),
        max_seq_len=max(SEQ_LENS),
        query_start_loc_host=qsl,
        seq_lens_host=list(SEQ_LENS),
        **extra,
    )
    scale = D**-0.5
    got = be.forward(torch.from_numpy(q), kc, vc, md, scale, k_scale=ks, v_scale=vs).numpy()
    for i in range(b):
        kq, ksr = quantize_kv_ref(ctx_k[i], kv)
        vq, vsr = quantize_kv_ref(ctx_v[i], kv)
        qi = q[qsl[i] : qsl[i + 1]]
        ref = _np_attention(qi, dequantize_kv_ref(kq, ksr), dequantize_kv_ref(vq, vsr), scale)
        exact = _np_attention(qi, ctx_k[i], ctx_v[i], scale)
        np.testing.assert_allclose(got[qsl[i] : qsl[i + 1]], ref, atol=2e-5, rtol=1e-5)
        # The cache really is quantized: off the float answer, by a quantization-sized amount.
        err = np.abs(got[qsl[i] : qsl[i + 1]] - exact).max() / np.abs(exact).max()
        assert 1e-6 < err < (0.02 if kv == "int8" else 0.1), err
    # The cache holds the reference's codes and scales at every written slot.
    for i, lo, hi in old + new:
        if hi == lo:
            continue
        sl = torch.tensor(slots_of(i, lo, hi))
        q_ref, s_ref = quantize_kv_ref(ctx_k[i][lo:hi], kv)
        np.testing.assert_array_equal(
            kc.view(-1, HKV, D)[sl].float().numpy(), q_ref.astype(np.float32)
        )
        np.testing.assert_array_equal(ks.view(-1, HKV)[sl].numpy(), s_ref)


def test_triton_bf16_queries_read_int8_cache() -> None:
    """bf16 model dtype: q bf16, cache int8 codes; the Triton kernel vs its dequantizing reference."""
    from xlaserve.kernels_cuda.paged_attention import unified_attention, unified_attention_ref

    g = torch.Generator().manual_seed(0)
    n, lens, ql = 12, [13, 30], [1, 5]
    x = torch.randn(n, PAGE, HKV, D, generator=g)
    kc, ks = quantize_kv(x, torch.int8)
    vc, vs = quantize_kv(torch.randn(n, PAGE, HKV, D, generator=g), torch.int8)
    q = torch.randn(sum(ql), HQ, D, generator=g).to(torch.bfloat16)
    args = (
        q, kc, vc, None, torch.tensor([0, 1, 6], dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor([[0, 1, 2, 3, 11, 11, 11, 11], [4, 5, 6, 7, 8, 9, 10, 11]], dtype=torch.int32),
        5, 30, D**-0.5,
    )  # fmt: skip
    got = unified_attention(*args, k_scale=ks, v_scale=vs)
    ref = unified_attention_ref(*args, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="k_scale / v_scale needed"):
        unified_attention(*args)


# ---- runner / engine ------------------------------------------------------------------------

IDS = [(7 * i + 3) % 380 + 1 for i in range(40)]
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 2, 18, 77, 120, 64, 9, 33, 1, 8], [11] * 5]


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> str:  # noqa: ANN001
    return tiny_model_dir("llama")


def _runner(path: str, **kw: object):  # noqa: ANN202
    from xlaserve.backends_torch.runner import TorchModelRunner
    from xlaserve.config import EngineConfig
    from xlaserve.model_loader.registry import build_spec

    return TorchModelRunner(EngineConfig.from_kwargs(model=path, **kw), build_spec(path))


def test_runner_caches_and_capacity(llama: str) -> None:
    """Blocks from the same byte budget: K and V take D * elem bytes each per (token, KV head) in
    float vs D + 4 quantized (codes + a float32 scale): ratio D * elem / (D + 4)."""
    budget = 3 << 20
    for dtype, elem in (("float32", 4), ("bfloat16", 2)):
        base = _runner(llama, dtype=dtype, block_size=4, cpu_kv_cache_bytes=budget)
        n_float = base.determine_num_kv_blocks()
        spec = base.spec
        per_head = 4 * 2 * spec.num_layers * spec.num_kv_heads  # block_size * (K, V) * L * Hkv
        assert n_float == budget // (per_head * spec.head_dim * elem)
        for kv in KV_DTYPES:
            r = _runner(
                llama, dtype=dtype, block_size=4, cpu_kv_cache_bytes=budget, kv_cache_dtype=kv
            )
            n = r.determine_num_kv_blocks()
            assert n == budget // (per_head * (spec.head_dim + 4))
            ratio = spec.head_dim * elem / (spec.head_dim + 4)  # D=16: 3.2 (fp32), 1.6 (bf16)
            assert abs(n / n_float - ratio) < 1e-3 * ratio
            r.init_kv_cache(n)
            k_q, v_q, k_s, v_s = r.kv_caches[0]
            assert k_q.dtype == v_q.dtype == KV_CODE_DTYPES[kv]
            assert k_q.shape == (n, 4, spec.num_kv_heads, spec.head_dim)
            assert k_s.dtype == torch.float32 and k_s.shape == (n, 4, spec.num_kv_heads)
            got = sum(t.numel() * t.element_size() for layer in r.kv_caches for t in layer)
            assert got == n * r.kv_bytes_per_block()


def test_tiny_llama_logits_and_greedy_tokens(llama: str) -> None:
    from xlaserve import LLM, SamplingParams

    ref = runner_logits(llama, IDS, dtype="float32")
    # Measured: rel 0.011 (int8), 0.064 (fp8: 3 mantissa bits); top-1 0.975 / 0.825.
    for kv, bound, top1 in (("int8", 0.02, 0.95), ("fp8", 0.1, 0.75)):
        got = runner_logits(llama, IDS, dtype="float32", kv_cache_dtype=kv)
        rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        assert 0 < rel <= bound, (kv, rel)
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= top1
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    for kv in ("auto", "int8"):
        llm = LLM(llama, backend="torch", dtype="float32", block_size=4, kv_cache_dtype=kv)
        res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        outs[kv] = [r.outputs[0].token_ids for r in res]
        llm.llm_engine.shutdown()
    assert outs["int8"] == outs["auto"]


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_runner_triton_backend_matches_torch_batched(llama: str, kv: str, monkeypatch) -> None:  # noqa: ANN001
    """The whole tiny model with the Triton kernels (interpreter) on the quantized cache gives
    the CPU default backend's logits: same codes and scales, float attention over them."""
    ids = IDS[:24]
    ref = runner_logits(llama, ids, dtype="float32", kv_cache_dtype=kv)
    monkeypatch.setenv("XLASERVE_ATTENTION_BACKEND", "triton")
    got = runner_logits(llama, ids, dtype="float32", kv_cache_dtype=kv)
    np.testing.assert_allclose(got, ref, atol=2e-4, rtol=1e-4)


def test_draft_model_cache_follows_int8(llama: str) -> None:
    """Speculative decoding with a draft model: the draft's cache is quantized too (same dtype,
    same block ids); greedy tokens equal the plain int8 engine's, the self-draft's are accepted."""
    from xlaserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    base = dict(dtype="float32", block_size=4, num_kv_blocks=64, kv_cache_dtype="int8")
    plain = LLM(llama, backend="torch", **base)
    ref = [r.outputs[0].token_ids for r in plain.generate(prompts, params, use_tqdm=False)]
    plain.llm_engine.shutdown()
    spec = {"method": "draft_model", "model": llama, "num_speculative_tokens": 3}
    llm = LLM(llama, backend="torch", speculative_config=spec, **base)
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.llm_engine.runner
    assert len(runner.draft_kv_caches[0]) == 4 and runner.draft_kv_caches[0][0].dtype == torch.int8
    st = llm.llm_engine.get_stats()
    llm.llm_engine.shutdown()
    assert got == ref
    assert 0 < st.spec_num_accepted_tokens == st.spec_num_draft_tokens


def test_offload_host_tier_with_int8_cache(llama: str) -> None:
    """A prefix evicted from the device comes back from the host tier (codes and scales): the
    same greedy tokens as the same int8 engine without offload."""
    from xlaserve import LLM, SamplingParams

    prefix = list(range(10, 50))
    a, filler, b = prefix + [60, 61], list(range(100, 140)), prefix + [70, 71, 72]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = dict(dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=64)
    outs, stats = {}, {}
    for off in (0, 1 << 20):
        llm = LLM(llama, backend="torch", kv_cache_dtype="int8", kv_offload_bytes=off, **base)
        outs[off] = [
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
            for p in (a, filler, b)
        ]
        stats[off] = llm.llm_engine.get_stats()
        if off:
            off_eng = llm.llm_engine.runner.kv_offload
            assert [h.dtype for h in off_eng.host] == [torch.int8, torch.float32]
            bb = llm.llm_engine.kv_manager.offload.block_bytes
            assert bb == sum(h[0].numel() * h.element_size() for h in off_eng.host)
        llm.llm_engine.shutdown()
    assert outs[1 << 20] == outs[0]
    assert stats[0].kv_offload_host_hits == 0 and stats[1 << 20].kv_offload_host_hits == 24


def test_offload_copy_engine_fp8_round_trip(tmp_path) -> None:  # noqa: ANN001
    from xlaserve.backends_torch.kv_offload import TorchKVOffload

    g = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(2):
        kq, kscale = quantize_kv(torch.randn(6, 4, 2, 8, generator=g), torch.float8_e4m3fn)
        vq, vscale = quantize_kv(torch.randn(6, 4, 2, 8, generator=g), torch.float8_e4m3fn)
        caches.append((kq, vq, kscale, vscale))
    before = [tuple(t.clone() for t in layer) for layer in caches]
    eng = TorchKVOffload(lambda: [caches], 0, 1, str(tmp_path), num_slots=2)
    assert [h.shape for h in eng.host] == [(2, 2, 2, 4, 2, 8), (2, 2, 2, 4, 2)]
    eng.apply([], [(1, 0)], [], [])  # block 1 -> slot 0
    eng.apply([(0, 7)], [], [(7, 1)], [])  # slot 0 -> disk -> slot 1
    eng.apply([], [], [], [(1, 5)])  # slot 1 -> block 5
    for layer, ref in zip(caches, before, strict=True):
        for t, t0 in zip(layer, ref, strict=True):
            assert torch.equal(t[5].float(), t0[1].float())  # fp8 -> float is exact
            assert torch.equal(t[:5].float(), t0[:5].float())


def test_mla_quantized_cache_close_to_float(tmp_path) -> None:  # noqa: ANN001
    """MLA caches full per-head K / V (V zero-padded): int8 / fp8 caches serve it like any
    other attention, within the same logit bounds as the demo model's."""
    from arch_zoo import make_arch_model

    path = make_arch_model("deepseek_v3", str(tmp_path / "ds"))
    ids = [(7 * i) % 200 + 3 for i in range(40)]
    ref = runner_logits(path, ids)
    for kv, bound, top1 in (("int8", 0.02, 0.95), ("fp8", 0.08, 0.9)):
        got = runner_logits(path, ids, kv_cache_dtype=kv)
        rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        print(f"MLA {kv} KV logits relative error: {rel:.5f}")
        assert 0 < rel <= bound, (kv, rel)
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= top1, kv


def test_unsupported_backends_are_refused(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from arch_zoo import make_arch_model

    from xlaserve.backends_torch.layers.attention import register_attention_backend

    path = make_arch_model("deepseek_v3", str(tmp_path / "ds"))
    register_attention_backend(
        "kvq_test_other", "xlaserve.backends_torch.layers.attention:TorchRefAttention"
    )
    monkeypatch.setenv("XLASERVE_ATTENTION_BACKEND", "kvq_test_other")
    with pytest.raises(ValueError, match="not supported by attention backend 'kvq_test_other'"):
        _runner(path, kv_cache_dtype="fp8")


def test_demo_perplexity_int8_fp8_kv_cache() -> None:
    from test_quant_model import HELD_OUT_TEXT

    from xlaserve.demo import demo_model_path
    from xlaserve.tokenizer import Tokenizer

    d = demo_model_path()
    ids = Tokenizer.from_dir(d).encode(HELD_OUT_TEXT)
    logits = {kv: runner_logits(d, ids, kv_cache_dtype=kv) for kv in ("auto", *KV_DTYPES)}
    ppl = {kv: perplexity(x, ids) for kv, x in logits.items()}
    print(f"demo perplexity by kv_cache_dtype: {ppl}")  # the figure in bench/RESULTS.md (-s)
    assert 15.0 < ppl["auto"] < 22.0  # the demo model's measured 18.575
    ref = logits["auto"]
    for kv, ppl_tol, rel_bound, top1 in (("int8", 0.01, 0.006, 0.98), ("fp8", 0.03, 0.025, 0.93)):
        assert abs(ppl[kv] / ppl["auto"] - 1) <= ppl_tol, (kv, ppl)
        rel = float(np.linalg.norm(logits[kv] - ref) / np.linalg.norm(ref))
        assert 0 < rel <= rel_bound, (kv, rel)  # > 0: the quantized cache is really read
        assert (logits[kv].argmax(-1) == ref.argmax(-1)).mean() >= top1
