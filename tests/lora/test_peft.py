"""PEFT adapter loading (xlaserve/lora/peft.py): shapes, scaling, and each bad adapter refused
with a ValueError that names the problem."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from lora_utils import ATTN, write_peft

from xlaserve.lora import LoRARequest
from xlaserve.lora.peft import load_peft_adapter
from xlaserve.model_loader.registry import build_spec


@pytest.fixture(scope="module")
def base(tiny_model_dir) -> str:  # noqa: ANN001
    return tiny_model_dir("llama")


def _load(path: str, base: str, max_rank: int = 16):  # noqa: ANN202
    return load_peft_adapter(LoRARequest("a", 1, path), build_spec(base), max_rank)


def test_loads_scaled_weights(tmp_path, base: str) -> None:  # noqa: ANN001
    p = write_peft(str(tmp_path / "a"), base, rank=4, alpha=8.0)
    ad = _load(p, base)
    assert (ad.rank, ad.scaling, ad.name, ad.int_id) == (4, 2.0, "a", 1)
    assert len(ad.weights) == 2 * 7
    from safetensors.numpy import load_file

    raw = load_file(os.path.join(p, "adapter_model.safetensors"))
    a, b = ad.weights[(1, "k_proj")]
    key = "base_model.model.model.layers.1.self_attn.k_proj"
    assert a.shape == (4, 64) and b.shape == (32, 4)  # k: 2 KV heads x 16
    np.testing.assert_array_equal(a, raw[f"{key}.lora_A.weight"])
    np.testing.assert_allclose(b, raw[f"{key}.lora_B.weight"] * 2.0, rtol=1e-6)


def test_rslora_scaling_and_regex_targets(tmp_path, base: str) -> None:  # noqa: ANN001
    p = write_peft(str(tmp_path / "a"), base, rank=8, alpha=4.0, targets=ATTN, rslora=True,
                   target_modules=r".*\.(q|k|v|o)_proj")  # fmt: skip
    ad = _load(p, base)
    assert math.isclose(ad.scaling, 4.0 / math.sqrt(8))
    assert {m for _, m in ad.weights} == set(ATTN)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        ("no_config", "missing adapter_config.json"),
        ("no_weights", "missing adapter_model.safetensors"),
        ("rank", "rank 32 exceeds max_lora_rank 16"),
        ("dora", "DoRA"),
        ("embed_target", "embedding adapters are not supported"),
        ("lm_head_target", "lm_head adapters are not supported"),
        ("unknown_target", "target module 'fc1' is not supported"),
        ("shape", r"layer 0 q_proj: lora_A \(4, 48\)"),
        ("layer", "layer 5 out of range"),
        ("modules_to_save", "modules_to_save"),
        ("missing_b", "lora_B is missing"),
        ("not_dir", "not a directory"),
    ],
)
def test_bad_adapters(tmp_path, base: str, mutate: str, match: str) -> None:  # noqa: ANN001
    p = str(tmp_path / "bad")
    rank = 32 if mutate == "rank" else 4
    write_peft(p, base, rank=rank)
    cfg_path = os.path.join(p, "adapter_config.json")
    w_path = os.path.join(p, "adapter_model.safetensors")
    with open(cfg_path) as f:
        cfg = json.load(f)
    from safetensors.numpy import load_file, save_file

    w = load_file(w_path)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    if mutate == "no_config":
        os.remove(cfg_path)
    elif mutate == "no_weights":
        os.remove(w_path)
    elif mutate == "dora":
        cfg["use_dora"] = True
    elif mutate == "embed_target":
        cfg["target_modules"] = ["q_proj", "embed_tokens"]
    elif mutate == "lm_head_target":
        cfg["target_modules"] = ["lm_head"]
    elif mutate == "unknown_target":
        cfg["target_modules"] = ["fc1"]
    elif mutate == "shape":
        w[f"{key}.lora_A.weight"] = np.zeros((4, 48), np.float32)
    elif mutate == "layer":
        w[key.replace("layers.0", "layers.5") + ".lora_A.weight"] = w[f"{key}.lora_A.weight"]
        w[key.replace("layers.0", "layers.5") + ".lora_B.weight"] = w[f"{key}.lora_B.weight"]
    elif mutate == "modules_to_save":
        cfg["modules_to_save"] = ["lm_head"]
    elif mutate == "missing_b":
        del w[f"{key}.lora_B.weight"]
    elif mutate == "not_dir":
        p = os.path.join(p, "nope")
    with open(cfg_path if os.path.exists(os.path.dirname(cfg_path)) else os.devnull, "w") as f:
        if mutate != "no_config":
            json.dump(cfg, f)
    if mutate != "no_weights":
        save_file(w, w_path)
    if mutate == "no_config" and os.path.exists(cfg_path):
        os.remove(cfg_path)
    with pytest.raises(ValueError, match=match) as e:
        _load(p, base)
    assert "LoRA adapter" in str(e.value)


def test_moe_expert_weights_refused(tmp_path) -> None:  # noqa: ANN001
    """Attention LoRA is fine on an MoE model; adapters on its expert (or MLP) weights are not."""
    from safetensors.numpy import save_file

    from xlaserve.model_loader.spec import ModelSpec

    spec = ModelSpec(architecture="MixtralForCausalLM", family="llama", vocab_size=64,
                     hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                     num_kv_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    p = tmp_path / "moe"
    p.mkdir()
    (p / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2}))
    a, b = np.ones((2, 16), np.float32), np.ones((16, 2), np.float32)
    pre = "base_model.model.model.layers.0"
    save_file({f"{pre}.self_attn.o_proj.lora_A.weight": a,
               f"{pre}.self_attn.o_proj.lora_B.weight": b}, str(p / "adapter_model.safetensors"))  # fmt: skip
    ad = load_peft_adapter(LoRARequest("m", 1, str(p)), spec, 8)
    assert list(ad.weights) == [(0, "o_proj")]
    save_file({f"{pre}.mlp.experts.0.down_proj.lora_A.weight": np.ones((2, 32), np.float32),
               f"{pre}.mlp.experts.0.down_proj.lora_B.weight": b}, str(p / "adapter_model.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match="MoE expert weights"):
        load_peft_adapter(LoRARequest("m", 1, str(p)), spec, 8)
    save_file({f"{pre}.mlp.down_proj.lora_A.weight": np.ones((2, 32), np.float32),
               f"{pre}.mlp.down_proj.lora_B.weight": b}, str(p / "adapter_model.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match="no down_proj in layer 0"):
        load_peft_adapter(LoRARequest("m", 1, str(p)), spec, 8)


def test_lora_request_imports_from_vllms_path() -> None:
    from xlaserve.lora import LoRARequest
    from xlaserve.lora.request import LoRARequest as FromVllmPath

    assert FromVllmPath is LoRARequest
    with pytest.raises(ValueError, match="lora_int_id"):
        FromVllmPath("a", 0, "/nowhere")
