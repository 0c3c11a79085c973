"""Quantized KV cache (kv_cache_dtype "int8" / "fp8") on the XLA backend, tiny Llama, CPU.

- logits (teacher-forced, prefilled in chunks so later chunks read the quantized cache) equal
  those of the float cache whose K/V are fake-quantized with the numpy contract (the int8 path
  is exactly "attention over dequantized K/V"), and stay within a stated tolerance of the float
  cache; greedy tokens through LLM.generate equal the float cache's;
- the KV block count from cpu_kv_cache_bytes follows the contract's bytes exactly;
- tensor parallel 2 (scales sharded with their KV heads) gives tensor parallel 1's tokens;
- host/disk offload carries the scales (bit-exact round trip; same tokens as without offload);
- MLA models use the quantized cache too (logits within the int8 bound).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from xla_helpers import make_runner

from xlaserve import LLM, SamplingParams
from xlaserve.models_flax.layers import clear_block_traces
from xlaserve.quantization.kv_quant import dequantize_kv_ref, quantize_kv_ref
from xlaserve.runner import CachedRequestData, NewRequestData, SchedulerOutput

# Stated tolerances: max |logit - float-cache logit| <= TOL * max |float-cache logit|.
TOL = {"int8": 0.03, "fp8": 0.15}
SEQS = [[int(x) for x in np.random.default_rng(i).integers(1, 384, 40)] for i in range(2)]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("jax-cache-kvq"))


def _teacher_logits(runner, tokens: list[int], chunk: int = 8) -> np.ndarray:  # noqa: ANN001
    """float32 logits [len(tokens), V] of one request prefilled `chunk` tokens per step."""
    blocks = list(range(-(-len(tokens) // runner.block_size)))[::-1]
    model = nnx.merge(runner.graphdef, runner.state)
    out = []
    for c in range(0, len(tokens), chunk):
        n = min(chunk, len(tokens) - c)
        so = SchedulerOutput()
        if c == 0:
            p = SamplingParams(temperature=0.0)
            so.new_requests.append(NewRequestData("r", list(tokens), len(tokens), p, blocks, 0))
        else:
            so.cached_requests.append(CachedRequestData("r", [], c))
        so.num_scheduled_tokens["r"] = n
        so.total_num_scheduled_tokens = n
        runner._update_states(so)
        _, hidden, _ = runner._forward(runner._prepare(so))
        out.append(np.asarray(model.compute_logits(hidden[:n]), np.float32))
        runner.requests["r"].num_computed_tokens += n
    runner._update_states(SchedulerOutput(finished_req_ids={"r"}))
    return np.concatenate(out)


def _logits(path: str, cache_dir: str, kv: str) -> list[np.ndarray]:
    runner = make_runner(path, cache_dir, kv_cache_dtype=kv, dtype="float32", enforce_eager=True)
    try:
        return [_teacher_logits(runner, s) for s in SEQS]
    finally:
        runner.shutdown()


def _fake_quant_write(kv: str):  # noqa: ANN202
    """write_kv storing quantize -> dequantize of the new K/V (numpy contract, via a callback)."""
    from xlaserve.kernels_pallas import write_kv

    def qdq(x: np.ndarray) -> np.ndarray:
        return dequantize_kv_ref(*quantize_kv_ref(np.asarray(x), kv)).astype(np.float32)

    def fake(k_cache, v_cache, k, v, slots):  # noqa: ANN001, ANN202
        shape = jax.ShapeDtypeStruct(k.shape, jnp.float32)
        k = jax.pure_callback(qdq, shape, k.astype(jnp.float32))
        v = jax.pure_callback(qdq, shape, v.astype(jnp.float32))
        return write_kv(k_cache, v_cache, k, v, slots)

    return fake


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_logits_equal_attention_over_dequantized_kv(
    tiny_model_dir, cache_dir: str, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    path = tiny_model_dir("llama")
    got = _logits(path, cache_dir, kv)
    ref = _logits(path, cache_dir, "auto")
    # The layers' traces are shared in the process (layers.call_block): the patched write_kv
    # must be traced afresh, and its traces must not outlive the patch.
    with monkeypatch.context() as m:
        m.setattr("xlaserve.models_flax.attention.write_kv", _fake_quant_write(kv))
        clear_block_traces()
        try:
            fake = _logits(path, cache_dir, "auto")
        finally:
            clear_block_traces()
    for g, r, f in zip(got, ref, fake, strict=True):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, f, atol=2e-4, rtol=1e-4)  # the same numbers, exactly-ish
        err = np.abs(g - r).max() / np.abs(r).max()
        assert 0 < err <= TOL[kv], err  # quantized (not a float cache by mistake), and close


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE_KW = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
                 max_num_batched_tokens=16, max_num_seqs=4)  # fmt: skip


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, 384, n).tolist() for n in (7, 20, 3, 30)][1:]


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_int8_greedy_tokens_equal_float_cache(tiny_model_dir, cache_dir: str) -> None:  # noqa: ANN001
    path = tiny_model_dir("llama")
    kw = dict(ENGINE_KW, enforce_eager=True, compilation_cache_dir=cache_dir)
    toks = {}
    for kv in ("auto", "int8"):
        llm = LLM(path, backend="xla", kv_cache_dtype=kv, **kw)
        toks[kv] = _greedy(llm)
        assert llm.llm_engine.runner.kv_caches[0][0].dtype == (
            jnp.int8 if kv == "int8" else jnp.float32
        )
    assert toks["int8"] == toks["auto"]
    assert all(len(t) == 8 for t in toks["auto"]) and len({tuple(t) for t in toks["auto"]}) == 3


def test_torch_and_xla_int8_caches_give_the_same_tokens(tiny_model_dir, cache_dir: str) -> None:  # noqa: ANN001
    """Both backends implement the same contract (xlaserve.quantization.kv_quant)."""
    path = tiny_model_dir("llama")
    xla = _greedy(LLM(path, backend="xla", kv_cache_dtype="int8", enforce_eager=True,
                      compilation_cache_dir=cache_dir, **ENGINE_KW))  # fmt: skip
    torch_llm = LLM(path, backend="torch", kv_cache_dtype="int8", **ENGINE_KW)
    assert torch_llm.llm_engine.runner.kv_cache_dtype == "int8"
    assert _greedy(torch_llm) == xla


def test_num_kv_blocks_follow_contract_bytes(tiny_model_dir, cache_dir: str) -> None:  # noqa: ANN001
    path = tiny_model_dir("llama")
    budget = 3_000_000
    n = {}
    for kv in ("auto", "int8", "fp8"):
        r = make_runner(path, cache_dir, load=False, kv_cache_dtype=kv, dtype="float32",
                        num_kv_blocks=None, cpu_kv_cache_bytes=budget)  # fmt: skip
        n[kv] = r.determine_num_kv_blocks()
        sp, s = r.spec, r.block_size
        per_token = sp.kv_bytes_per_token(4, kv)
        assert n[kv] == budget // (s * per_token)
        # Contract bytes: 2 (K, V) * layers * Hkv * (D + 4) quantized, * D * 4 in float32.
        per_head = sp.head_dim * 4 if kv == "auto" else sp.head_dim + 4
        assert per_token == 2 * sp.num_layers * sp.num_kv_heads * per_head
    assert n["int8"] == n["fp8"] == budget // (4 * 2 * 2 * 2 * (16 + 4))  # 4687 blocks
    assert n["auto"] == budget // (4 * 2 * 2 * 2 * 16 * 4)  # 1464 blocks: 3.2x fewer
    # The allocated arrays take exactly those bytes.
    r = make_runner(path, cache_dir, kv_cache_dtype="int8", dtype="float32", enforce_eager=True)
    caches = r.kv_caches
    assert [str(a.dtype) for a in caches[0]] == ["int8", "int8", "float32", "float32"]
    assert caches[0][2].shape == caches[0][0].shape[:3]
    total = sum(a.nbytes for layer in caches for a in layer)
    assert total == r.num_kv_blocks * r.block_size * r.spec.kv_bytes_per_token(4, "int8")
    r.shutdown()


def test_tensor_parallel_2_matches_1_with_int8(tiny_model_dir, cache_dir: str) -> None:  # noqa: ANN001
    path = tiny_model_dir("llama")
    worker = os.path.join(os.path.dirname(__file__), "kv_quant_tp_worker.py")
    proc = subprocess.run(
        [sys.executable, worker, path, cache_dir, "int8", "1,2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["1"]["tokens"] == res["2"]["tokens"]
    assert all(len(t) == 6 for t in res["1"]["tokens"])
    assert res["2"]["devices"] == 2 and res["2"]["dtypes"] == ["int8", "float32"]
    assert res["2"]["kv_spec"][:3] == [None, None, "model"]  # KV heads split ...
    assert res["2"]["scale_spec"] == [None, None, "model"]  # ... and their scales with them


def test_offload_round_trip_carries_scales(tiny_model_dir, cache_dir: str, tmp_path) -> None:  # noqa: ANN001
    from xlaserve.backends_xla.kv_offload import XlaKVOffload

    path = tiny_model_dir("llama")
    r = make_runner(path, cache_dir, kv_cache_dtype="int8", dtype="float32", enforce_eager=True,
                    num_kv_blocks=8)  # fmt: skip
    rng = np.random.default_rng(3)
    # Fill the cache with known codes and scales.
    caches = [
        tuple(
            jax.device_put(
                rng.integers(-127, 128, a.shape).astype(np.int8)
                if a.dtype == jnp.int8
                else rng.uniform(0.01, 1, a.shape).astype(np.float32),
                a.sharding,
            )
            for a in layer
        )
        for layer in r.kv_caches
    ]
    want = [[np.asarray(a) for a in layer] for layer in caches]
    block_bytes = r.block_size * r.spec.kv_bytes_per_token(4, "int8")
    off = XlaKVOffload(caches, 3, block_bytes, r._kv_layer_shardings, str(tmp_path))
    assert [h.dtype for h in off.hosts] == [np.int8, np.float32]
    off.copy_out(caches, [(5, 0), (2, 1)])
    # Slot 0 -> disk -> slot 2; then blocks 5 and 2 come back into blocks 1 and 6.
    caches = off.apply(caches, [(0, 0xABC)], [], [(0xABC, 2)], [(2, 1), (1, 6)])
    files = [f for d in tmp_path.iterdir() for f in d.iterdir()]
    assert len(files) == 1 and os.path.getsize(files[0]) > block_bytes  # header + codes + scales
    got = [[np.asarray(a) for a in layer] for layer in caches]
    for w, g in zip(want, got, strict=True):
        for wa, ga in zip(w, g, strict=True):
            np.testing.assert_array_equal(ga[1], wa[5])
            np.testing.assert_array_equal(ga[6], wa[2])
            keep = [0, 2, 3, 4, 5, 7]
            np.testing.assert_array_equal(ga[keep], wa[keep])
    assert caches[0][2].sharding == r._kv_layer_shardings[2]
    r.shutdown()


def test_offload_engine_same_tokens_with_int8(tiny_model_dir, cache_dir: str) -> None:  # noqa: ANN001
    """The host tier serves an evicted int8 prefix (as tests/offload/test_offload_engine.py)."""
    path = tiny_model_dir("llama")
    prefix = list(range(10, 50))
    prompts = [prefix + [60, 61], list(range(100, 140)), prefix + [70, 71, 72]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = dict(dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=64,
                kv_cache_dtype="int8", compilation_cache_dir=cache_dir, max_num_batched_tokens=16,
                max_num_seqs=2, enforce_eager=True)  # fmt: skip

    def run(**kw: object) -> tuple[list[list[int]], object]:
        llm = LLM(path, backend="xla", **base, **kw)
        outs = [
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
            for p in prompts
        ]
        return outs, llm.llm_engine.get_stats()

    ref, _ = run()
    out, s = run(kv_offload_bytes=1 << 20)
    assert out == ref
    assert s.kv_offload_host_hits == 24  # B's 6 evicted prefix blocks came back from the host


def test_mla_quantized_cache_close_to_float(tmp_path, cache_dir: str) -> None:  # noqa: ANN001
    """DeepSeek-V3-style MLA caches full per-head K / V (V zero-padded): the int8 cache goes
    through the same write-and-attend path, with logits within the int8 bound of the float cache."""
    from arch_zoo import make_arch_model

    path = make_arch_model("deepseek_v3", str(tmp_path / "ds"))
    ref = np.concatenate(_logits(path, cache_dir, "auto"))
    got = np.concatenate(_logits(path, cache_dir, "int8"))
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    print(f"MLA int8 KV logits relative error: {rel:.5f}")
    assert 0 < rel <= 0.02  # > 0: the quantized cache is really read
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


def test_bad_kv_cache_dtype_refused(tiny_model_dir) -> None:  # noqa: ANN001
    from xlaserve.config import EngineConfig

    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig.from_kwargs(model=path, kv_cache_dtype="int4")
