"""EAGLE draft heads (EAGLE-1 style): the checkpoint format and its checks (no torch, no jax).

A head is an HF-layout directory whose config.json names an architecture of `EAGLE_ARCHITECTURES`
and otherwise reads like a one-layer Llama config (hidden_size, heads, head_dim, intermediate_size,
rope, rms_norm_eps, vocab_size). Its `model.safetensors` holds only the head's own weights, named
canonically (see model_loader/spec.py):

    fc.weight [H, 2H], fc.bias [H]      input projection of [embed(token_p); feature_{p-1}]
    layers.0.*                          one Llama decoder layer (norms, attention, gated MLP)

The embedding and lm_head are the target's (shared, frozen). The feature of position p is the
target's final hidden state at p (after the last norm: the lm_head's input); the head's entry at
position p reads token p and feature p-1 (zeros at p = 0) and predicts feature p, whose lm_head
argmax is the draft for token p + 1. The shipped demo head: `assets/demo-kjv-eagle` (trained by
tools/train_eagle.py).
"""

from __future__ import annotations

from xlaserve.model_loader.registry import llama_spec, read_hf_config
from xlaserve.model_loader.spec import ModelSpec

EAGLE_ARCHITECTURES: tuple[str, ...] = ("EagleLlamaForCausalLM",)


def build_eagle_spec(model_dir: str, target: ModelSpec) -> ModelSpec:
    """The head's ModelSpec (family "llama", one layer), checked against the target's spec.

    Raises ValueError for a directory that is not an EAGLE head, or a head whose hidden size or
    vocabulary does not match the target (it was trained for another model)."""
    cfg = read_hf_config(model_dir)
    arch = cfg["architectures"][0]
    if arch not in EAGLE_ARCHITECTURES:
        raise ValueError(
            f"{model_dir}: architecture {arch!r} is not an EAGLE head (expected one of "
            f"{', '.join(EAGLE_ARCHITECTURES)}); a full draft model goes with method 'draft_model'"
        )
    spec = llama_spec(cfg, model_dir)
    if spec.num_layers != 1:
        raise ValueError(f"{model_dir}: an EAGLE head has one decoder layer, got {spec.num_layers}")
    if spec.hidden_size != target.hidden_size:
        raise ValueError(
            f"EAGLE head {model_dir} has hidden size {spec.hidden_size} but the target model's is "
            f"{target.hidden_size}: the head was trained for another model"
        )
    if spec.vocab_size != target.vocab_size:
        raise ValueError(
            f"EAGLE head {model_dir} has vocabulary {spec.vocab_size} but the target model's is "
            f"{target.vocab_size}: the head was trained for another model"
        )
    return spec
