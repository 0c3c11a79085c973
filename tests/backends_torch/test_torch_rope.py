"""rope_inv_freq (numpy, backend-neutral) vs transformers' ROPE_INIT_FUNCTIONS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xlaserve.model_loader.registry import llama_spec
from xlaserve.model_loader.rope import apply_rope_np, rope_cos_sin, rope_inv_freq

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=4096,
)

CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
        "rope_theta": 500000.0,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "rope_theta": 1000000.0,
    },
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "original_max_position_embeddings": 512,
        "rope_theta": 10000.0,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(16)],
        "long_factor": [2.0 + 0.3 * i for i in range(16)],
        "original_max_position_embeddings": 1024,
        "rope_theta": 10000.0,
    },
}


def _hf(rope_parameters: dict) -> tuple[torch.Tensor, float, dict]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(**BASE, rope_parameters=dict(rope_parameters))
    kind = rope_parameters["rope_type"]
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        inv, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        inv, scale = ROPE_INIT_FUNCTIONS[kind](cfg)
    d = cfg.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    return inv, float(scale), d


@pytest.mark.parametrize("case", list(CASES))
def test_inv_freq_matches_transformers(case: str) -> None:
    inv_ref, scale_ref, cfg = _hf(CASES[case])
    spec = llama_spec(cfg, "")
    inv, scale = rope_inv_freq(spec)
    assert inv.dtype == np.float32 and inv.shape == (spec.rotary_dim // 2,) == tuple(inv_ref.shape)
    np.testing.assert_allclose(inv, inv_ref.numpy(), rtol=2e-6, atol=0)
    assert scale == pytest.approx(scale_ref, rel=1e-6)
    if case != "default" and case != "dynamic":
        # The scaling must actually change something (guards against silently ignoring it).
        base, _ = rope_inv_freq(
            llama_spec({**cfg, "rope_parameters": None, "rope_scaling": None}, "")
        )
        assert not np.allclose(inv, base)


def test_longrope_long_factor_beyond_original() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(**BASE, rope_parameters=dict(CASES["longrope"]))
    ref, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, seq_len=2048)
    d = {**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}
    inv, _ = rope_inv_freq(llama_spec(d, ""), seq_len=2048)
    np.testing.assert_allclose(inv, ref.numpy(), rtol=2e-6)


def test_unknown_rope_type_raises() -> None:
    d = {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "rope_scaling": {"rope_type": "weird", "factor": 2.0},
    }
    with pytest.raises(ValueError, match="weird"):
        rope_inv_freq(llama_spec(d, ""))


def test_cos_sin_and_rotation_match_hf() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inv = (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    pos = np.array([0, 1, 5, 77, 200])
    cos, sin = rope_cos_sin(inv, pos, 1.3)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((5, 3, 16)).astype(np.float32)
    out = apply_rope_np(q, cos, sin)
    cos_f = torch.from_numpy(np.concatenate([cos, cos], -1))[None]
    sin_f = torch.from_numpy(np.concatenate([sin, sin], -1))[None]
    qt = torch.from_numpy(q).transpose(0, 1)[None]  # [1, heads, T, D]
    ref, _ = apply_rotary_pos_emb(qt, qt, cos_f, sin_f)
    np.testing.assert_allclose(out, ref[0].transpose(0, 1).numpy(), atol=1e-5)
    # Position 0 rotates nothing (up to the attention factor).
    np.testing.assert_allclose(out[0], q[0] * 1.3, atol=1e-6)
