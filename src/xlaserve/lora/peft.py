"""PEFT LoRA adapters -> `LoRAAdapter` (numpy + safetensors only; no torch / jax).

A PEFT directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules as a
list or a regex string, fan_in_fan_out, ...) and `adapter_model.safetensors` with keys like
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (A [r, in]) and
`....lora_B.weight` (B [out, r]). The LoRA forward is `lora_B(lora_A(x)) * scaling` whatever
fan_in_fan_out says (that flag only describes the base weight's layout when merging), so the
adapter maps onto our [out, in] linears as is.

Rules (each broken one is a `ValueError` naming the directory / file and the module):
- only plain LoRA: no DoRA, no LoRA bias, no modules_to_save, no per-module rank/alpha patterns;
- rank <= `max_lora_rank`;
- target modules are names from `LORA_MODULES` that the base has in that layer (embedding and
  lm_head adapters are refused, so are MoE expert weights and attention of MLA models);
- A / B shapes match the base's projection sizes and the configured rank.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import numpy as np

from xlaserve.lora import LORA_MODULES, LoRAAdapter, LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
# Modules PEFT can target that we refuse with a specific reason.
_REFUSED = {
    "embed_tokens": "embedding adapters are not supported (only linear projections)",
    "lm_head": "lm_head adapters are not supported (only linear projections)",
}
# `...layers.{i}.<path>.<module>.lora_<A|B>[.<adapter name>].weight`
_KEY = re.compile(r"layers\.(\d+)\.((?:[\w]+\.)*?)(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def lora_module_shapes(spec: Any, layer: int) -> dict[str, tuple[int, int]]:
    """module -> (in_features, out_features) of the LoRA-capable projections the base model has
    in `layer` (unfused, full size: a fused qkv / gate_up base applies the parts). `spec` is a
    ModelSpec. MoE layers have no dense MLP projections; MLA models no q/k/v."""
    out: dict[str, tuple[int, int]] = {}
    if spec.family != "mla" and not spec.extra.get("layer_kinds"):
        h = spec.hidden_size
        out.update(
            q_proj=(h, spec.q_size),
            k_proj=(h, spec.kv_size),
            v_proj=(h, spec.kv_size),
            o_proj=(spec.q_size, h),
        )
    if not spec.is_moe_layer(layer) and not spec.extra.get("layer_kinds"):
        h, i = spec.hidden_size, spec.intermediate_size
        if spec.gated_mlp:
            out["gate_proj"] = (h, i)
        out.update(up_proj=(h, i), down_proj=(i, h))
    return out


def _fail(path: str, msg: str) -> ValueError:
    return ValueError(f"LoRA adapter {path}: {msg}")


def read_adapter_config(path: str) -> dict[str, Any]:
    """The adapter's `adapter_config.json`, checked for options we do not support."""
    if not os.path.isdir(path):
        raise _fail(path, "not a directory (expected a PEFT adapter directory)")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise _fail(path, f"missing {CONFIG_FILE}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _fail(cfg_path, f"unreadable ({e})") from e
    if not isinstance(cfg, dict):
        raise _fail(cfg_path, "must hold a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _fail(cfg_path, f"peft_type {peft_type!r} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise _fail(cfg_path, "DoRA (use_dora) is not supported")
    if cfg.get("lora_bias"):
        raise _fail(cfg_path, "lora_bias is not supported")
    if cfg.get("bias", "none") not in (None, "none"):
        raise _fail(cfg_path, f"bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise _fail(cfg_path, f"modules_to_save {cfg['modules_to_save']} is not supported")
    for k in ("rank_pattern", "alpha_pattern"):
        if cfg.get(k):
            raise _fail(cfg_path, f"{k} (per-module rank / alpha) is not supported")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(cfg_path, f"r must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _fail(cfg_path, f"lora_alpha must be a number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            name = str(t).rsplit(".", 1)[-1]
            if name in _REFUSED:
                raise _fail(cfg_path, f"target module {t!r}: {_REFUSED[name]}")
            if name not in LORA_MODULES:
                raise _fail(
                    cfg_path,
                    f"target module {t!r} is not supported (supported: {', '.join(LORA_MODULES)})",
                )
    elif targets is not None and not isinstance(targets, str):
        raise _fail(cfg_path, f"target_modules must be a list or a regex string, got {targets!r}")
    return cfg


def adapter_scaling(cfg: dict[str, Any]) -> float:
    """lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    r, alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    return float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)


def load_peft_adapter(req: LoRARequest, spec: Any, max_lora_rank: int) -> LoRAAdapter:
    """Load `req.lora_path` into host memory for the base `spec` (a ModelSpec): float32 A [r, in]
    and B [out, r] per (layer, module), B multiplied by the scaling. Raises ValueError (see the
    module docstring for the rules)."""
    path = req.lora_path
    cfg = read_adapter_config(path)
    rank = cfg["r"]
    if rank > max_lora_rank:
        raise _fail(path, f"rank {rank} exceeds max_lora_rank {max_lora_rank}")
    scaling = adapter_scaling(cfg)
    wpath = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(wpath):
        extra = (
            " (adapter_model.bin is not supported)"
            if os.path.isfile(os.path.join(path, "adapter_model.bin"))
            else ""
        )
        raise _fail(path, f"missing {WEIGHTS_FILE}{extra}")
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(wpath)
    except (SafetensorError, OSError, ValueError) as e:
        raise _fail(wpath, f"unreadable ({e})") from e
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        if "lora_magnitude_vector" in key:
            raise _fail(wpath, f"{key}: DoRA weights are not supported")
        if "lora_embedding" in key or key.rsplit(".", 3)[0].endswith(("embed_tokens", "lm_head")):
            raise _fail(wpath, f"{key}: embedding / lm_head adapters are not supported")
        m = _KEY.search(key)
        if m is None:
            raise _fail(wpath, f"unexpected tensor {key!r} (not a layer's lora_A / lora_B weight)")
        layer, parent, module, ab = int(m.group(1)), m.group(2).rstrip("."), m.group(3), m.group(4)
        if "experts" in parent or "shared_expert" in parent:
            raise _fail(wpath, f"{key}: LoRA on MoE expert weights is not supported")
        if module not in LORA_MODULES:
            raise _fail(
                wpath,
                f"{key}: module {module!r} is not supported (supported: {', '.join(LORA_MODULES)})",
            )
        want_parent = "self_attn" if module in _ATTN else "mlp"
        if parent.rsplit(".", 1)[-1] != want_parent:
            raise _fail(wpath, f"{key}: expected {module} under {want_parent}, found {parent!r}")
        if not 0 <= layer < spec.num_layers:
            raise _fail(
                wpath, f"{key}: layer {layer} out of range (the base has {spec.num_layers})"
            )
        shapes = lora_module_shapes(spec, layer)
        if module not in shapes:
            why = " (an MoE layer: expert weights take no LoRA)" if module in _MLP else ""
            raise _fail(wpath, f"{key}: the base model has no {module} in layer {layer}{why}")
        slot = parts.setdefault((layer, module), {})
        if ab in slot:
            raise _fail(wpath, f"{key}: duplicate lora_{ab} for layer {layer} {module}")
        slot[ab] = t
    if not parts:
        raise _fail(wpath, "holds no lora_A / lora_B weights")
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise _fail(wpath, f"layer {layer} {module}: lora_{missing} is missing")
        fan_in, fan_out = lora_module_shapes(spec, layer)[module]
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise _fail(
                wpath,
                f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                f"not match the base ({(rank, fan_in)} / {(fan_out, rank)} for rank {rank})",
            )
        a32 = np.ascontiguousarray(a, dtype=np.float32)
        b32 = np.ascontiguousarray(b.astype(np.float32) * np.float32(scaling))
        if not (np.isfinite(a32).all() and np.isfinite(b32).all()):
            raise _fail(wpath, f"layer {layer} {module}: non-finite weights")
        weights[(layer, module)] = (a32, b32)
    return LoRAAdapter(req.lora_name, req.lora_int_id, rank, scaling, weights)
