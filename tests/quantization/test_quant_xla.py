"""Weight quantization on the XLA backend (models_flax QuantLinear), against the XLA float model
and the torch backend (the numpy quantizers are shared, so both backends hold the same integers).

Error metric as in test_quant_model.py: rel = ||logits_q - logits||_F / ||logits||_F over one
prefill of the tiny random Llama (40 tokens); bounds are the torch tests' (int8 0.06, int4 0.6,
GPTQ/AWQ 0.6, fp8 0.3). Measured on XLA: int8 0.030, int4 0.424, GPTQ 0.437 (desc_act 0.399),
AWQ 0.380, compressed-tensors fp8 0.180 — the torch figures. XLA vs torch, same quantization:
max |logit diff| <= 3e-5 (int8 7.9e-6, int4 7.6e-6, GPTQ/AWQ <= 6.1e-6, fp8 3.0e-5);
asserted <= 2e-4 (float32 summation order only).

Demo model perplexity (held-out Genesis 50:1-4): XLA float/int8/int4 give the torch backend's
18.575 / 18.584 / 18.477 to within 0.001 (asserted within 0.02).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from optional_deps import import_or_skip

jax = import_or_skip("jax")
import_or_skip("torch")
import_or_skip("transformers")

import jax.numpy as jnp  # noqa: E402
from quant_testlib import perplexity, runner_logits, write_prequantized  # noqa: E402

IDS = [(7 * i + 3) % 380 + 1 for i in range(40)]
BOUND = {"int8": 0.06, "int4": 0.6, "gptq": 0.6, "awq": 0.6, "compressed-tensors": 0.3}
XLA_VS_TORCH = 2e-4  # max |logit diff| between backends for the same quantized integers
TORCH_PPL = {None: 18.575, "int8": 18.584, "int4": 18.477}  # test_quant_model.py's figures


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def xla_runner(path: str, **kw: object):  # noqa: ANN201
    """An XlaModelRunner (model loaded, no KV cache or compiles) built like the engine's."""
    from xlaserve.backends_xla.runner import XlaModelRunner
    from xlaserve.config import EngineConfig
    from xlaserve.model_loader.registry import build_spec

    cfg = EngineConfig.from_kwargs(model=path, backend="xla", dtype="float32", **kw)
    runner = XlaModelRunner(cfg, build_spec(path))
    runner.load_model()
    return runner


def xla_logits(path: str, ids: list[int], **kw: object) -> np.ndarray:
    """Logits [T, V] float32 of every position of `ids` (one prefill) on the XLA runner's model."""
    return runner_prefill_logits(xla_runner(path, **kw), ids)


def runner_prefill_logits(runner, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    from flax import nnx

    from xlaserve.models_flax.attention import AttentionMetadata

    spec, model = runner.spec, nnx.merge(runner.graphdef, runner.state)
    n, s = len(ids), 16
    nb = -(-n // s)
    kv = jnp.zeros((nb, s, spec.num_kv_heads, spec.head_dim), jnp.float32)
    md = AttentionMetadata(
        slot_mapping=jnp.arange(n, dtype=jnp.int32),
        kv_lens=jnp.asarray([n], jnp.int32),
        block_tables=jnp.arange(nb, dtype=jnp.int32)[None, :],
        cu_q_lens=jnp.asarray([0, n], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
    )
    with jax.default_matmul_precision("highest"):
        hidden, _ = model(
            jnp.asarray(ids, jnp.int32),
            jnp.arange(n, dtype=jnp.int32),
            [(kv, kv)] * spec.num_layers,
            md,
        )
        return np.asarray(model.compute_logits(hidden))


@pytest.fixture(scope="module")
def src(tiny_model_dir) -> str:  # noqa: ANN001
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def float_logits(src: str) -> np.ndarray:
    return xla_logits(src, IDS)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_runtime_quantization_matches_float_and_torch(
    src: str, float_logits: np.ndarray, method: str
) -> None:
    from flax import nnx

    from xlaserve.models_flax.layers import Linear, QuantLinear

    r = xla_runner(src, quantization=method)
    got = runner_prefill_logits(r, IDS)
    assert 0 < rel(got, float_logits) <= BOUND[method]
    torch_q = runner_logits(src, IDS, quantization=method)
    assert np.abs(got - torch_q).max() <= XLA_VS_TORCH
    # The swap: every decoder linear quantized, the lm_head left in float (as on torch).
    model = nnx.merge(r.graphdef, r.state)
    mods = dict(nnx.iter_modules(model))
    q = [p for p, m in mods.items() if isinstance(m, QuantLinear)]
    assert len(q) == 2 * 7 and [p for p, m in mods.items() if type(m) is Linear] == [("lm_head",)]
    down = model.layers[0].mlp.down_proj  # K = intermediate 128
    if method == "int8":
        assert down.qweight[...].dtype == jnp.int8 and down.qweight[...].shape == (64, 128)
        assert down.scales[...].shape == (64,)
    else:
        assert down.qweight[...].dtype == jnp.uint8 and down.qweight[...].shape == (64, 64)
        assert down.scales[...].shape == (64, 1) and down.qzeros[...].dtype == jnp.uint8


def test_dummy_weights_quantized(src: str) -> None:
    """load_format='dummy' fills quantized layers from random float weights."""
    from flax import nnx

    r = xla_runner(src, quantization="int4", load_format="dummy")
    leaves = {str(p): v.get_value() for p, v in nnx.to_flat_state(r.state)}
    qw = [v for p, v in leaves.items() if "qweight" in p]
    assert len(qw) == 14 and all(v.dtype == jnp.uint8 and int(v.max()) > 0 for v in qw)


@pytest.mark.parametrize(
    "fmt,opts",
    [("gptq", {}), ("gptq", {"desc_act": True}), ("awq", {}), ("compressed-tensors", {})],
)
def test_prequantized_checkpoints_match_torch(
    src: str, float_logits: np.ndarray, tmp_path, fmt: str, opts: dict
) -> None:  # noqa: ANN001
    qdir = write_prequantized(src, str(tmp_path / fmt), fmt, group_size=32, **opts)
    r = xla_runner(qdir)  # format detected from config.json
    got = runner_prefill_logits(r, IDS)
    assert 0 < rel(got, float_logits) <= BOUND[fmt]
    assert np.abs(got - runner_logits(qdir, IDS)).max() <= XLA_VS_TORCH
    assert r.quant_scheme.source == fmt
    layer = r.state["layers"][0]["self_attn"]["q_proj"]
    assert ("perm" in layer) == bool(opts.get("desc_act"))
    with pytest.raises(ValueError, match="conflicts"):
        xla_runner(qdir, quantization="int8")


def test_moe_shared_expert_quantized_experts_float(tmp_path) -> None:  # noqa: ANN001
    """Qwen2-MoE: attention and the shared expert are quantized, the stacked routed experts and
    the router stay float (on both backends); logits agree across backends."""
    from arch_zoo import make_arch_model

    d = make_arch_model("qwen2_moe", str(tmp_path / "moe"))
    ids = IDS[:20]
    r = xla_runner(d, quantization="int4")
    got = runner_prefill_logits(r, ids)
    assert np.abs(got - runner_logits(d, ids, quantization="int4")).max() <= XLA_VS_TORCH
    mlp = r.state["layers"][0]["mlp"]
    assert "qweight" in mlp["shared_expert"]["down_proj"]
    assert mlp["experts"]["w_gate"].get_value().dtype == jnp.float32
    assert mlp["router"]["weight"].get_value().dtype == jnp.float32


def test_fp8_runtime_refused_on_cpu_and_emulation_matches_torch(
    src: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RuntimeError, match="fp8 needs an NVIDIA GPU with compute capability"):
        xla_runner(src, quantization="fp8")
    monkeypatch.setenv("XLASERVE_FP8_EMULATION", "1")
    got = xla_logits(src, IDS, quantization="fp8")
    assert np.abs(got - runner_logits(src, IDS, quantization="fp8")).max() <= XLA_VS_TORCH


def test_pallas_path_matches_xla_path() -> None:
    """The TPU branch of QuantLinear (Pallas kernels, interpret mode) vs its XLA dequant branch,
    and both vs the numpy dequantized weight."""
    from flax import nnx

    from xlaserve.kernels_pallas import compat
    from xlaserve.models_flax.layers import QuantLinear
    from xlaserve.quantization import dequantize_int4, dequantize_int8, quantize_weight

    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (128, 256)).astype(np.float32)
    b = rng.normal(0, 0.05, 128).astype(np.float32)
    x = jnp.asarray(rng.normal(0, 1, (5, 256)), jnp.float32)
    for method, group in (("int8", 0), ("int4", 128)):
        t = quantize_weight(method, w, group or 128)
        deq = dequantize_int8(*t.values()) if method == "int8" else dequantize_int4(*t.values())
        ref = np.asarray(x) @ deq.T + b
        outs = {}
        for impl in ("xla", "pallas_tpu"):
            layer = QuantLinear(256, 128, jnp.float32, True, None, method, group, impl=impl)
            for k, v in t.items():
                getattr(layer, k)[...] = jnp.asarray(v)
            layer.bias[...] = jnp.asarray(b)
            graphdef, state = nnx.split(layer)
            call = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))  # noqa: B023
            if impl == "pallas_tpu":
                with compat.tpu_interpret_mode():
                    outs[impl] = np.asarray(call(state, x))
            else:
                outs[impl] = np.asarray(call(state, x))
            np.testing.assert_allclose(outs[impl], ref, atol=2e-4, rtol=1e-4)
        assert np.abs(outs["xla"] - outs["pallas_tpu"]).max() <= 2e-4


def test_greedy_tokens_match_torch(src: str, tmp_path) -> None:  # noqa: ANN001
    from xlaserve import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9, 10], list(range(100, 121))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = dict(
        dtype="float32",
        block_size=4,
        num_kv_blocks=32,
        max_num_batched_tokens=16,
        max_num_seqs=2,
        max_model_len=64,
        compilation_cache_dir=str(tmp_path / "jax-cache"),
    )
    toks = {}
    for backend in ("xla", "torch"):
        for q in ("int8", "int4"):
            llm = LLM(src, backend=backend, quantization=q, **base)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            toks[backend, q] = [o.outputs[0].token_ids for o in outs]
            llm.llm_engine.shutdown()
    for q in ("int8", "int4"):
        assert toks["xla", q] == toks["torch", q]
        assert all(len(t) == 8 for t in toks["xla", q])
        assert len(set(toks["xla", q][1])) > 1  # not one repeated token


def test_demo_perplexity_matches_torch() -> None:
    from test_quant_model import HELD_OUT_TEXT

    from xlaserve.demo import demo_model_path
    from xlaserve.tokenizer import Tokenizer

    d = demo_model_path()
    ids = Tokenizer.from_dir(d).encode(HELD_OUT_TEXT)
    for q, want in TORCH_PPL.items():
        ppl = perplexity(xla_logits(d, ids, quantization=q), ids)
        print(f"XLA demo perplexity, quantization={q}: {ppl:.4f} (torch {want})")  # run with -s
        assert abs(ppl - want) <= 0.02, (q, ppl)


def test_orbax_refuses_quantization(src: str, tmp_path) -> None:  # noqa: ANN001
    """`xlaserve convert --to orbax` writes float parameters only: a pre-quantized source is
    refused with a clear message, and so is quantization= on an orbax directory."""
    from click.testing import CliRunner

    from xlaserve.backends_xla.orbax_io import MARKER_FILE
    from xlaserve.entrypoints.convert import convert

    qdir = write_prequantized(src, str(tmp_path / "gptq"), "gptq", group_size=32)
    res = CliRunner().invoke(convert, [qdir, str(tmp_path / "out"), "--to", "orbax"])
    assert res.exit_code != 0 and "pre-quantized" in res.output
    assert not os.path.exists(tmp_path / "out" / MARKER_FILE)
    fake = str(tmp_path / "orbax")  # an orbax directory as far as the loader's check goes
    shutil.copytree(src, fake)
    with open(os.path.join(fake, MARKER_FILE), "w") as f:
        json.dump({}, f)
    with pytest.raises(ValueError, match="orbax checkpoint"):
        xla_runner(fake, quantization="int8")
