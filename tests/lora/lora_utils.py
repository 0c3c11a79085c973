"""Tiny PEFT LoRA adapters for tests: random A / B written in PEFT's layout, and the reference
(transformers running the base with the adapter merged: W + scaling * B @ A)."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL = ATTN + MLP


def module_dims(model_dir: str) -> dict[str, tuple[int, int]]:
    """module -> (in, out) of a Llama-like HF config.json."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    h, i = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }  # fmt: skip


def write_peft(
    path: str,
    model_dir: str,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ALL,
    rslora: bool = False,
    seed: int = 0,
    std: float = 0.3,
    num_layers: int = 2,
    config_extra: dict | None = None,
    target_modules: list[str] | str | None = None,
) -> str:
    """A PEFT adapter dir for the tiny base at model_dir (random A and B; B is not zero, so the
    adapter changes the output)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    dims = module_dims(model_dir)
    tensors = {}
    for layer in range(num_layers):
        for m in targets:
            fan_in, fan_out = dims[m]
            part = "self_attn" if m in ATTN else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * std).astype(
                np.float32
            )
            tensors[f"{key}.lora_B.weight"] = (
                rng.standard_normal((fan_out, rank)) * std / math.sqrt(rank)
            ).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": list(targets) if target_modules is None else target_modules,
        "fan_in_fan_out": False,
        "bias": "none",
        "lora_dropout": 0.0,
        "base_model_name_or_path": model_dir,
        "task_type": "CAUSAL_LM",
        **(config_extra or {}),
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def merge_into(base_dir: str, adapter_dir: str, out_dir: str) -> str:
    """Save the base with the adapter merged (W += scaling * B @ A) as an HF model dir."""
    import torch
    import transformers as tf
    from safetensors.numpy import load_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    r = cfg["r"]
    scaling = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    model = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    w = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in w.items():
            if ".lora_A." not in key:
                continue
            b = w[key.replace(".lora_A.", ".lora_B.")]
            name = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            delta = torch.from_numpy(b.astype(np.float64) @ a.astype(np.float64)) * scaling
            params[name].add_(delta.to(torch.float32))
    model.save_pretrained(out_dir, safe_serialization=True)
    model.generation_config.save_pretrained(out_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(base_dir, f), os.path.join(out_dir, f))
    return out_dir
