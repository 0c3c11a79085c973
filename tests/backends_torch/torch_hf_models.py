"""Tiny random HF models of the Llama family used by the Torch backend tests."""

from __future__ import annotations

import torch

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _configs() -> dict[str, tuple[type, type, dict]]:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {
        "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
        "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
        "llama_yarn": (
            LlamaConfig,
            LlamaForCausalLM,
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "rope_theta": 10000.0,
                }
            ),
        ),
        "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=8, head_dim=16)),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=16)),
        # Qwen3 with sliding window on layer 1 only (layer_types from max_window_layers).
        "qwen3_sw": (
            Qwen3Config,
            Qwen3ForCausalLM,
            dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, head_dim=16),
        ),
    }


FAMILIES = list(_configs())


def make_hf_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    cfg_cls, model_cls, extra = _configs()[name]
    cfg = cfg_cls(**{**COMMON, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = model_cls(cfg).eval()
    # A large init scale (and non-trivial norms/biases) so greedy output does not degenerate and
    # every weight matters.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    return model.to(dtype)


def load_hf(model_dir: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    return m.eval()
