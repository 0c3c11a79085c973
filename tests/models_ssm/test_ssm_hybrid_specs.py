"""LFM2 / Nemotron-H / Falcon-H1 configs -> ModelSpec and cache layout (model_loader/
ssm_hybrids.py; no model is built): layer kinds, LFM2's feed-forward width, the cache groups of
each layer kind, Nemotron-H's MoE layers refused, Falcon-H1's multipliers folded exactly."""

from __future__ import annotations

import numpy as np
import pytest

from xlaserve.model_loader import ssm_hybrids
from xlaserve.model_loader.ssm import cache_layout, is_state_model

ATTN = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=100)


def test_lfm2_spec(tmp_path) -> None:  # noqa: ANN001
    # LFM2-1.2B's feed-forward: 2/3 of block_ff_dim 12288, rounded to 256 -> 8192.
    cfg = dict(
        ATTN, architectures=["Lfm2ForCausalLM"], hidden_size=64, intermediate_size=12288,
        block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
        num_hidden_layers=4, full_attn_idxs=[1, 3], conv_L_cache=3, norm_eps=1e-5,
    )  # fmt: skip
    spec = ssm_hybrids.lfm2_spec(cfg, str(tmp_path))
    assert spec.intermediate_size == 8192 and spec.qk_norm and spec.norm_eps == 1e-5
    assert spec.extra["layer_kinds"] == ["shortconv", "attention", "shortconv", "attention"]
    assert is_state_model(spec)
    layout = cache_layout(spec, dtype_bytes=2, block_size=16)
    # Two conv layers, a [64, 2] float32 window each; two attention layers' K/V per block.
    assert layout.bytes_per_slot == 2 * 4 * 64 * 2
    assert layout.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 2


def test_nemotron_h_spec_and_moe_refused(tmp_path) -> None:  # noqa: ANN001
    cfg = dict(
        ATTN, architectures=["NemotronHForCausalLM"], hidden_size=64, head_dim=16,
        hybrid_override_pattern="M*-M-", mamba_num_heads=8, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, conv_kernel=4, intermediate_size=128,
    )  # fmt: skip
    spec = ssm_hybrids.nemotron_h_spec(cfg, str(tmp_path))
    assert spec.extra["layer_kinds"] == ["mamba2", "attention", "mlp", "mamba2", "mlp"]
    assert spec.num_layers == 5 and spec.position_embedding == "none"
    assert spec.activation == "relu2" and not spec.gated_mlp
    layout = cache_layout(spec, dtype_bytes=2, block_size=16)
    groups = {g.kind: g.layers for g in layout.groups}
    assert groups == {"attention": (1,), "recurrent_state": (0, 3)}  # "mlp" layers: no cache
    with pytest.raises(ValueError, match="MoE layers"):
        ssm_hybrids.nemotron_h_spec({**cfg, "hybrid_override_pattern": "M*E"}, str(tmp_path))


def _falcon_cfg() -> dict:
    return dict(
        ATTN, architectures=["FalconH1ForCausalLM"], hidden_size=64, num_hidden_layers=2,
        intermediate_size=96, mamba_d_ssm=128, mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, ssm_in_multiplier=3.0,
        ssm_multipliers=[2.0, 3.0, 5.0, 7.0, 11.0], key_multiplier=0.5,
        attention_in_multiplier=2.0, mlp_multipliers=[4.0, 8.0], lm_head_multiplier=0.25,
    )  # fmt: skip


def test_falcon_h1_spec_layout(tmp_path) -> None:  # noqa: ANN001
    spec = ssm_hybrids.falcon_h1_spec(_falcon_cfg(), str(tmp_path))
    assert spec.extra["layer_kinds"] == ["parallel", "parallel"]
    assert spec.extra["ssm"]["gate_norm"] == "none" and spec.logits_scaling == 4.0
    layout = cache_layout(spec, dtype_bytes=2, block_size=16)
    # Every layer holds K/V blocks AND a state slot (conv [128 + 64, 3], ssm [8, 16, 16]).
    assert [g.layers for g in layout.groups] == [(0, 1), (0, 1)]
    assert layout.bytes_per_slot == 2 * 4 * ((128 + 2 * 2 * 16) * 3 + 8 * 16 * 16)
    assert layout.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 2


def test_falcon_h1_multipliers_folded(tmp_path) -> None:  # noqa: ANN001
    spec = ssm_hybrids.falcon_h1_spec(_falcon_cfg(), str(tmp_path))
    rows = 128 + (128 + 64) + 8
    w = np.ones((rows, 64), np.float32)

    def conv(name: str, arr: np.ndarray) -> np.ndarray:
        (out_name, out), *_ = ssm_hybrids.falcon_h1_convert(name, arr, spec)
        return out

    got = conv("model.layers.0.mamba.in_proj.weight", w)[:, 0]
    # z | x | B | C | dt rows, each times its ssm multiplier and ssm_in_multiplier 3.
    want = np.concatenate([np.full(n, 3.0 * m) for n, m in
                           zip([128, 128, 32, 32, 8], [2.0, 3.0, 5.0, 7.0, 11.0], strict=True)])  # fmt: skip
    np.testing.assert_array_equal(got, want)
    one = np.ones((32, 64), np.float32)
    assert conv("model.layers.1.self_attn.k_proj.weight", one)[0, 0] == 0.5 * 2.0
    assert conv("model.layers.1.self_attn.k_proj.bias", one[0])[0] == 0.5  # bias: key only
    assert conv("model.layers.1.self_attn.q_proj.weight", one)[0, 0] == 2.0
    assert conv("model.layers.1.feed_forward.gate_proj.weight", one)[0, 0] == 4.0
    assert conv("model.layers.1.feed_forward.down_proj.weight", one)[0, 0] == 8.0
    assert conv("model.layers.1.feed_forward.up_proj.weight", one)[0, 0] == 1.0
    with pytest.raises(ValueError, match="quantized tensor"):
        conv("model.layers.1.self_attn.q_proj.qweight", one.astype(np.int32))


def test_prefix_caching_off_shared_prefix(ssm_model_dir, caplog) -> None:  # noqa: ANN001
    """Prefix caching on a recurrent-state model: asked for, it is disabled with a log line
    (kv_cache_manager.py; no state snapshots at block boundaries), so a second request sharing
    a 3-block prefix recomputes it: no prefix-cache hits, tokens still equal transformers'."""
    import logging

    from tiny_models import hf_greedy

    from xlaserve import LLM, SamplingParams

    path = ssm_model_dir("lfm2")
    prefix = list(range(60, 72))
    prompts = [prefix + [7, 8], prefix + [9]]
    want = hf_greedy(path, prompts, 4)
    with caplog.at_level(logging.INFO, logger="xlaserve.core.kv_cache_manager"):
        llm = LLM(
            path, backend="torch", dtype="float32", block_size=4, max_model_len=64,
            enable_prefix_caching=True,
        )  # fmt: skip
    assert "prefix caching is disabled: the model has recurrent-state layers" in caplog.text
    assert not llm.llm_engine.core.kv_manager.enable_prefix_caching
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = []
    for p in prompts:  # one after the other: the first one's blocks are free when the second comes
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        got.append(out[0].outputs[0].token_ids)
    assert got == want
    assert llm.llm_engine.get_stats().prefix_cache_hits == 0
