"""Checkpoint layouts as the hub ships them: sharded safetensors with an index, tied / untied
heads, fused or split projections, the dtype in config.json; anything else a clear error naming
the missing piece. Backend-neutral checks on the canonical weight stream, plus the torch model's
logits where loading is what could go wrong."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from arch_zoo import PROMPTS, load_hf
from safetensors.numpy import load_file, save_file

from xlaserve.model_loader.registry import build_spec, iter_canonical_weights


def _canonical(path: str) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in iter_canonical_weights(build_spec(path))}


def _copy_config(src: str, dst: str, **changes: object) -> str:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def _rewrite(src: str, dst: str, edit) -> str:  # noqa: ANN001 - edit(dict) -> dict
    """A copy of checkpoint `src` whose single safetensors file is rewritten by `edit`."""
    _copy_config(src, dst)
    tensors = edit(load_file(os.path.join(src, "model.safetensors")))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_sharded_index_loads_like_one_file(arch_model_dir, tmp_path) -> None:  # noqa: ANN001
    from test_models_torch_parity import _ours, _ragged_last_logits

    path = arch_model_dir("glm4")  # fused gate_up_proj, interleaved rope, sandwich norms
    sharded = str(tmp_path / "sharded")
    hf = load_hf(path)
    hf.save_pretrained(sharded, max_shard_size="40KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 2 and not os.path.exists(os.path.join(sharded, "model.safetensors"))
    _assert_same(_canonical(sharded), _canonical(path))
    spec, model = _ours(sharded)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    torch.testing.assert_close(_ragged_last_logits(spec, model, PROMPTS), ref, rtol=1e-4, atol=2e-4)
    # A shard listed in the index but absent: the error names it.
    gone = sorted(shards)[1]
    os.remove(os.path.join(sharded, gone))
    with pytest.raises(FileNotFoundError, match=gone):
        _canonical(sharded)


def test_dtype_comes_from_config(arch_model_dir, tmp_path) -> None:  # noqa: ANN001
    from xlaserve.backends_torch.memory import resolve_dtype

    path = str(tmp_path / "bf16")
    load_hf(arch_model_dir("helium")).to(torch.bfloat16).save_pretrained(path)
    spec = build_spec(path)
    assert spec.checkpoint_dtype == "bfloat16"
    assert {a.dtype.name for a in _canonical(path).values()} == {"bfloat16"}
    assert resolve_dtype("auto", spec.checkpoint_dtype, "cuda") == torch.bfloat16
    assert resolve_dtype("float32", spec.checkpoint_dtype, "cuda") == torch.float32


def test_tied_and_untied_heads(arch_model_dir, tmp_path) -> None:  # noqa: ANN001
    from test_models_torch_parity import _ours

    # Tied: a checkpoint that still carries lm_head.weight (some hub uploads do) loads,
    # the copy is dropped.
    tied = arch_model_dir("qwen2")
    assert build_spec(tied).tie_word_embeddings

    def add_head(t: dict) -> dict:
        return {**t, "lm_head.weight": t["model.embed_tokens.weight"].copy()}

    extra = _rewrite(tied, str(tmp_path / "tied"), add_head)
    _assert_same(_canonical(extra), _canonical(tied))
    # Untied without its lm_head: the error names the missing tensor.
    untied = arch_model_dir("helium")
    assert not build_spec(untied).tie_word_embeddings
    headless = _rewrite(
        untied,
        str(tmp_path / "untied"),
        lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"},
    )
    with pytest.raises(ValueError, match="missing.*lm_head.weight"):
        _ours(headless)


def test_fused_and_split_projections_load_alike(arch_model_dir, tmp_path) -> None:  # noqa: ANN001
    path = arch_model_dir("helium")  # checkpoint with split q/k/v and gate/up

    def fuse(t: dict) -> dict:
        out = {}
        for k, v in t.items():
            if ".self_attn.q_proj." in k:
                parts = [t[k.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
                out[k.replace("q_proj", "qkv_proj")] = np.concatenate(parts)
            elif ".mlp.gate_proj." in k:
                up = t[k.replace("gate_proj", "up_proj")]
                out[k.replace("gate_proj", "gate_up_proj")] = np.concatenate([v, up])
            elif not any(s in k for s in (".k_proj.", ".v_proj.", ".up_proj.")):
                out[k] = v
        return out

    fused = _rewrite(path, str(tmp_path / "fused"), fuse)
    _assert_same(_canonical(fused), _canonical(path))
    # And the other way round: Phi3 ships fused qkv_proj / gate_up_proj; split tensors load too.
    phi3 = arch_model_dir("phi3")
    spec = build_spec(phi3)

    def split(t: dict) -> dict:
        out = {}
        for k, v in t.items():
            if k.endswith("qkv_proj.weight"):
                q, kv = spec.q_size, spec.kv_size
                for p, a in zip(("q", "k", "v"), (v[:q], v[q : q + kv], v[q + kv :]), strict=True):
                    out[k.replace("qkv_proj", f"{p}_proj")] = np.ascontiguousarray(a)
            elif k.endswith("gate_up_proj.weight"):
                i = spec.intermediate_size
                out[k.replace("gate_up_proj", "gate_proj")] = np.ascontiguousarray(v[:i])
                out[k.replace("gate_up_proj", "up_proj")] = np.ascontiguousarray(v[i:])
            else:
                out[k] = v
        return out

    _assert_same(_canonical(_rewrite(phi3, str(tmp_path / "split"), split)), _canonical(phi3))


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("falcon", {"alibi": True}, "FalconForCausalLM with alibi=True"),
        ("stablelm", {"qk_layernorm": True}, "qk_layernorm=True"),
        ("cohere", {"use_qk_norm": True}, "use_qk_norm=True"),
        ("opt", {"do_layer_norm_before": False}, "do_layer_norm_before=False"),
        ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
        ("ernie4_5_moe", {"use_bias": True}, "use_bias=True"),
    ],
)
def test_unsupported_config_names_the_piece(
    name: str, change: dict, message: str, arch_model_dir, tmp_path
) -> None:  # noqa: ANN001
    path = _copy_config(arch_model_dir(name), str(tmp_path / name), **change)
    with pytest.raises(ValueError, match=message):
        build_spec(path)


@pytest.mark.parametrize("heads", [1, 4, 6, 12, 16, 40])
def test_alibi_slopes_match_transformers(heads: int) -> None:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from xlaserve.model_loader.families import bloom_alibi_slopes, mpt_alibi_slopes

    want = _get_alibi_slopes(heads, torch.device("cpu")).tolist()
    np.testing.assert_allclose(bloom_alibi_slopes(heads), want, rtol=1e-6)
    # MPT's tensor is slope * (k - (L - 1)); at k = L - 2 it is -slope.
    mpt = -build_mpt_alibi_tensor(heads, 2).reshape(heads, 2)[:, 0]
    np.testing.assert_allclose(mpt_alibi_slopes(heads), mpt.tolist(), rtol=1e-6)


def test_gpt_oss_mxfp4_experts_are_named(arch_model_dir, tmp_path) -> None:  # noqa: ANN001
    path = arch_model_dir("gpt_oss")

    def mxfp4(t: dict) -> dict:
        return {**t, "model.layers.0.mlp.experts.gate_up_proj_blocks": np.zeros(4, np.uint8)}

    with pytest.raises(ValueError, match="MXFP4"):
        _canonical(_rewrite(path, str(tmp_path / "mxfp4"), mxfp4))
