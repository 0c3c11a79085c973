"""Fused projections and the Triton elementwise ops of the torch models (CPU).

- structure: every layer holds one qkv_proj and (gated MLPs) one gate_up_proj, no q/k/v/gate/up;
- the fused model's logits equal the unfused model's (XLASERVE_FUSE_PROJECTIONS=0) to 1e-5 (fp32)
  for Llama, Qwen2 (qkv bias), Qwen3 (qk-norm), Phi3 (fused checkpoint), OLMo2 (full qk-norm),
  Qwen2-MoE (shared expert MLP) and DeepSeek-V3 (MLA: q_a + kv_a fused);
- a checkpoint with fused canonical tensors (qkv_proj / gate_up_proj) loads to the same model;
- pre-quantized fallbacks: GPTQ act-order and partial ignore lists stay unfused;
- TP: with 4 ranks and 2 KV heads (each KV head on 2 ranks) every rank's fused qkv rows are its
  own q, k, v shards (the end-to-end TP 2 run is tests/distributed/test_torch_tp.py);
- Triton rotary (in place) + act-and-mul forced on CPU tensors (TRITON_INTERPRET=1): logits match
  the torch ops, and greedy tokens through the engine match on a tiny Llama.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
from arch_zoo import make_arch_model
from quant_testlib import prefill_metadata

from xlaserve.backends_torch.layers.linear import MergedLinear, can_fuse
from xlaserve.backends_torch.models import get_model_class
from xlaserve.model_loader.registry import build_spec, iter_canonical_weights

IDS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300]


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = make_arch_model(name, str(tmp_path_factory.mktemp(f"fused-{name}")))
        return cache[name]

    return get


def _build(path: str, weights: object = None) -> tuple[object, torch.nn.Module]:
    spec = build_spec(path)
    model = get_model_class(spec.family)(spec, dtype=torch.float32, device="cpu")
    model.load_weights(iter_canonical_weights(spec) if weights is None else weights)
    return spec, model.eval()


def _logits(spec: object, model: torch.nn.Module, ids: list[int] = IDS) -> torch.Tensor:
    """One prefill of `ids` over a paged cache (block size 4) -> logits [T, V] float32."""
    n, s = len(ids), 4
    md, nblk = prefill_metadata(n, s)
    shape = (nblk, s, spec.num_kv_heads, spec.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    hidden = model(torch.tensor(ids), torch.arange(n), caches, md)
    return model.compute_logits(hidden)


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "qwen3", "phi3", "olmo2", "qwen2_moe", "deepseek_v3"]
)
def test_fused_equals_unfused(arch_dir, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    path = arch_dir(arch)
    spec, fused = _build(path)
    monkeypatch.setenv("XLASERVE_FUSE_PROJECTIONS", "0")
    _, plain = _build(path)
    for layer, ref in zip(fused.layers, plain.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        fused_attn = attn.fused_qkv_a_proj if arch == "deepseek_v3" else attn.qkv_proj
        assert isinstance(fused_attn, MergedLinear) and attn.fused and not ref.self_attn.fused
        assert not any(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "kv_a_proj"))
        gated = mlp.shared_expert if arch == "qwen2_moe" else mlp
        if gated is not None and not hasattr(gated, "experts"):  # dense or shared-expert MLP
            assert isinstance(gated.gate_up_proj, MergedLinear)
            assert not hasattr(gated, "gate_proj") and not hasattr(gated, "up_proj")
            assert gated.gate_up_proj.weight.shape[0] == 2 * gated.down_proj.in_features
    if arch == "qwen2":
        assert fused.layers[0].self_attn.qkv_proj.bias is not None
    if arch in ("llama", "qwen2", "qwen3", "phi3"):
        qkv = fused.layers[0].self_attn.qkv_proj
        assert qkv.part_names == ("q_proj", "k_proj", "v_proj")
        assert qkv.weight.shape == (spec.q_size + 2 * spec.kv_size, spec.hidden_size)
        # Same weights, only laid out together: rows [q | k | v].
        ra = plain.layers[0].self_attn
        ref_w = torch.cat([ra.q_proj.weight, ra.k_proj.weight, ra.v_proj.weight])
        assert torch.equal(qkv.weight, ref_w)
    a, b = _logits(spec, fused), _logits(spec, plain)
    assert a.abs().max() > 1.0  # a real signal, not a degenerate model
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _fuse_canonical(pairs: list[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
    """Separate canonical q/k/v and gate/up tensors -> fused qkv_proj / gate_up_proj tensors."""
    d = dict(pairs)
    out = {}
    groups = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, arr in d.items():
        prefix, _, part = name.rpartition(".")
        parent, _, member = prefix.rpartition(".")
        for fused, members in groups.items():
            if member == members[0]:
                out[f"{parent}.{fused}.{part}"] = np.concatenate(
                    [d[f"{parent}.{m}.{part}"] for m in members]
                )
                break
            if member in members:
                break
        else:
            out[name] = arr
    assert any("qkv_proj" in n for n in out) and any("gate_up_proj" in n for n in out)
    return list(out.items())


def test_fused_checkpoint_tensors_load(arch_dir) -> None:  # noqa: ANN001
    path = arch_dir("qwen2")  # with the qkv bias
    spec, model = _build(path)
    pairs = list(iter_canonical_weights(spec))
    _, model2 = _build(path, _fuse_canonical(pairs))
    torch.testing.assert_close(_logits(spec, model), _logits(spec, model2), atol=0, rtol=0)
    # A member missing from the checkpoint is reported.
    partial = [(n, a) for n, a in pairs if n != "layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.qkv_proj\.weight"):
        _build(path, partial)


def _with_quant_config(tmp_path, qc: dict) -> str:  # noqa: ANN001
    cfg = {"architectures": ["LlamaForCausalLM"], "quantization_config": qc}
    d = tmp_path / f"q{len(os.listdir(tmp_path))}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_prequantized_fallbacks(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    qkv0 = [f"layers.0.self_attn.{p}_proj" for p in "qkv"]
    qkv1 = [f"layers.1.self_attn.{p}_proj" for p in "qkv"]
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq"}
    assert can_fuse(None, qkv0)  # float checkpoint
    assert can_fuse(_with_quant_config(tmp_path, {**gptq, "desc_act": False}), qkv0)
    # act-order: every member has its own input permutation -> separate layers
    assert not can_fuse(_with_quant_config(tmp_path, {**gptq, "desc_act": True}), qkv0)
    ct = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}
        },
        "ignore": ["model.layers.0.self_attn.q_proj"],
    }
    d = _with_quant_config(tmp_path, ct)
    assert not can_fuse(d, qkv0)  # q float, k/v fp8: cannot share one layer
    assert can_fuse(d, qkv1)
    monkeypatch.setenv("XLASERVE_FUSE_PROJECTIONS", "0")
    assert not can_fuse(None, qkv0)


def test_tp_fused_shards_hold_their_own_heads(tiny_model_dir, monkeypatch) -> None:  # noqa: ANN001
    """4 ranks (no communication needed to build and load), 4 q heads, 2 KV heads: rank r holds
    q head r and KV head r // 2 in one qkv_proj; gate/up hold their quarter each."""
    from xlaserve.backends_torch.distributed import parallel_state as ps
    from xlaserve.backends_torch.distributed.layers import (
        MergedColumnParallelLinear,
        tp_weight_stream,
    )

    path = tiny_model_dir("qwen2")  # qkv bias
    spec = build_spec(path)
    assert (spec.num_heads, spec.num_kv_heads) == (4, 2)
    full = dict(iter_canonical_weights(spec))
    d, inter = spec.head_dim, spec.intermediate_size
    for rank in range(4):
        monkeypatch.setattr(ps, "_TP", ps.TPGroup(rank, 4, None, None, "gloo"))
        model = get_model_class(spec.family)(spec)
        model.load_weights(tp_weight_stream(model, iter_canonical_weights(spec)))
        attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
        assert isinstance(attn.qkv_proj, MergedColumnParallelLinear)
        assert attn.qkv_sizes == (d, d, d)
        for part in ("weight", "bias"):
            f = {p: full[f"layers.1.self_attn.{p}_proj.{part}"] for p in "qkv"}
            kv = rank // 2
            want = np.concatenate(
                [f["q"][rank * d : (rank + 1) * d], f["k"][kv * d : (kv + 1) * d],
                 f["v"][kv * d : (kv + 1) * d]]
            )  # fmt: skip
            np.testing.assert_array_equal(getattr(attn.qkv_proj, part).numpy(), want)
            # A fused full tensor is cut to the same rows.
            whole = np.concatenate([f["q"], f["k"], f["v"]])
            np.testing.assert_array_equal(attn.qkv_proj.shard_array(part, whole), want)
        q = inter // 4
        g, u = (full[f"layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up"))
        want = np.concatenate([g[rank * q : (rank + 1) * q], u[rank * q : (rank + 1) * q]])
        np.testing.assert_array_equal(mlp.gate_up_proj.weight.numpy(), want)


@pytest.mark.parametrize("arch", ["llama", "gemma", "phi3", "deepseek_v3"])
def test_triton_ops_match_torch_ops(arch_dir, arch: str) -> None:  # noqa: ANN001
    """Triton rotary (in place on views of qkv; partial rotary for Phi3; MLA's rope slices) and
    silu / gelu_tanh act-and-mul, run by the interpreter on CPU tensors, vs the torch ops."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    spec, model = _build(arch_dir(arch))
    assert not model.triton_ops  # CPU default: torch ops
    ref = _logits(spec, model)
    model.set_triton_ops(True)
    rot = next(m for m in model.modules() if hasattr(m, "cos_sin_cache"))
    assert rot.cos_sin_cache is not None and rot.cos_sin_cache.shape[0] >= len(IDS)
    got = _logits(spec, model)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    model.set_triton_ops(False)
    torch.testing.assert_close(_logits(spec, model), ref, atol=0, rtol=0)


def test_triton_ops_greedy_tokens_engine(tiny_model_dir, monkeypatch) -> None:  # noqa: ANN001
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    from xlaserve.config import EngineConfig
    from xlaserve.engine.llm_engine import LLMEngine
    from xlaserve.sampling_params import SamplingParams

    path = tiny_model_dir("llama")
    prompts = [[5, 9, 33, 71, 2, 18, 140], [300, 4]]

    def greedy() -> tuple[list[list[int]], bool]:
        cfg = EngineConfig.from_kwargs(
            model=path,
            backend="torch",
            dtype="float32",
            block_size=4,
            num_kv_blocks=32,
            max_model_len=64,
        )
        engine = LLMEngine(cfg)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        on = engine.runner.model.triton_ops
        engine.shutdown()
        return [done[f"r{i}"] for i in range(len(prompts))], on

    ref, on = greedy()
    assert not on
    monkeypatch.setenv("XLASERVE_TRITON_OPS", "1")
    got, on = greedy()
    assert on
    assert got == ref and len({tuple(r) for r in ref}) > 1
    # As on the GPU: Triton attention too, fed strided q/k/v views of the fused qkv output.
    monkeypatch.setenv("XLASERVE_ATTENTION_BACKEND", "triton")
    got, on = greedy()
    assert on and got == ref
