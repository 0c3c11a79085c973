"""HF `architectures` name -> adapter (ModelSpec builder + weight-name map), one table both
backends use. Adding an architecture = one `ArchAdapter` here + (if it needs a new family) one
model file per backend."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from xlaserve.model_loader.spec import ModelSpec

# (hf_name, array, spec) -> canonical (name, array) pairs; [] drops the tensor.
WeightConverter = Callable[[str, np.ndarray, ModelSpec], Iterable[tuple[str, np.ndarray]]]


@dataclass(frozen=True)
class ArchAdapter:
    family: str
    build_spec: Callable[[dict, str], ModelSpec]
    convert: WeightConverter


_ADAPTERS: dict[str, ArchAdapter] = {}


def register_architecture(names: list[str], adapter: ArchAdapter) -> None:
    for name in names:
        _ADAPTERS[name] = adapter


def supported_architectures() -> list[str]:
    return sorted(_ADAPTERS)


def get_adapter(architecture: str) -> ArchAdapter:
    if architecture not in _ADAPTERS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    return _ADAPTERS[architecture]


def _eos_ids(cfg: dict, model_dir: str) -> list[int]:
    ids: list[int] = []
    gen = os.path.join(model_dir, "generation_config.json") if model_dir else ""
    sources = [cfg]
    if gen and os.path.exists(gen):
        with open(gen) as f:
            sources.insert(0, json.load(f))
    for src in sources:
        v = src.get("eos_token_id")
        if v is None:
            continue
        for t in v if isinstance(v, list) else [v]:
            if t not in ids:
                ids.append(int(t))
    return ids


def base_spec_kwargs(cfg: dict, model_dir: str) -> dict:
    """Fields common to most HF decoder configs."""
    n_heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    return dict(
        architecture=cfg["architectures"][0],
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg.get("intermediate_size", 4 * hidden),
        num_layers=cfg["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or hidden // n_heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        model_dir=model_dir,
        checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        norm_eps=cfg.get("rms_norm_eps", cfg.get("layer_norm_eps", 1e-6)),
        rope_theta=float(
            cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        ),
        rope_scaling=_rope_scaling(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg, model_dir),
        activation=_act(cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))),
    )


def _rope_scaling(cfg: dict) -> dict | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    rs = dict(rs)
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    rs["rope_type"] = kind
    return rs


def _act(name: str) -> str:
    return {
        "silu": "silu",
        "swish": "silu",
        "gelu": "gelu",
        "gelu_new": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh",
        "gelu_fast": "gelu_tanh",
        "relu": "relu",
    }.get(name, name)


_LAYER_RE = re.compile(r"^model\.")


def llama_convert(name: str, w: np.ndarray, spec: ModelSpec) -> Iterable[tuple[str, np.ndarray]]:
    """Llama-layout checkpoints: canonical name = HF name without the `model.` prefix."""
    if "rotary_emb" in name:
        return []
    if name == "lm_head.weight" and spec.tie_word_embeddings:
        return []
    return [(_LAYER_RE.sub("", name), w)]


def llama_spec(cfg: dict, model_dir: str) -> ModelSpec:
    kw = base_spec_kwargs(cfg, model_dir)
    arch = kw["architecture"]
    kw.update(
        family="llama",
        qkv_bias=bool(cfg.get("attention_bias", arch.startswith("Qwen2"))),
        o_bias=bool(cfg.get("attention_bias", False)) and not arch.startswith("Qwen2"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch.startswith("Qwen3"),
    )
    sw = cfg.get("sliding_window")
    if sw and (cfg.get("use_sliding_window", True) or arch.startswith("Mistral")):
        if arch.startswith(("Qwen2", "Qwen3")):
            # Qwen: sliding only in layers >= max_window_layers, and only when enabled.
            if cfg.get("use_sliding_window", False):
                mwl = cfg.get("max_window_layers", kw["num_layers"])
                kw["sliding_window"] = sw
                kw["layer_types"] = cfg.get("layer_types") or [
                    "sliding" if i >= mwl else "full" for i in range(kw["num_layers"])
                ]
        else:
            kw["sliding_window"] = sw
    return ModelSpec(**kw)


register_architecture(
    ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"],
    ArchAdapter(family="llama", build_spec=llama_spec, convert=llama_convert),
)


def read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{model_dir}: config.json not found (expected an HF-layout model directory)"
        )
    with open(path) as f:
        cfg = json.load(f)
    if not cfg.get("architectures"):
        raise ValueError(f"{path}: no 'architectures' field")
    return cfg


def build_spec(model_dir: str) -> ModelSpec:
    cfg = read_hf_config(model_dir)
    adapter = get_adapter(cfg["architectures"][0])
    return adapter.build_spec(cfg, model_dir)


def iter_canonical_weights(
    spec: ModelSpec, load_format: str = "auto"
) -> Iterator[tuple[str, np.ndarray]]:
    """Canonical (name, array) pairs for `spec`'s checkpoint, converted by its adapter."""
    from xlaserve.model_loader.weights import iter_pickle, iter_safetensors

    if spec.model_dir is None:
        raise ValueError("spec has no model_dir to read weights from")
    adapter = get_adapter(spec.architecture)
    source = (
        iter_pickle(spec.model_dir) if load_format == "pt" else iter_safetensors(spec.model_dir)
    )
    for name, w in source:
        yield from adapter.convert(name, w, spec)
