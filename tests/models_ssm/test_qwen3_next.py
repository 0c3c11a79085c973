"""Qwen3-Next (gated delta-net linear attention + gated attention + MoE) on both backends: the
gated delta rule references (torch and jnp: chunked WY form and single step equal the sequential
recurrence, chunks carry the state exactly), the Pallas kernels in interpret mode, and greedy
tokens through the engine equal transformers' generate for a mixed-length batch, also under a
tight cache forcing chunked prefill and preemption."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from tiny_models import hf_greedy

from xlaserve.backends_torch.layers import gdn_ops

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [40, 41, 42],
    list(range(100, 123)),
    [200],
]
MAX_NEW = 6
GREEDY = dict(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PRESSURE = dict(
    block_size=4, max_model_len=32, num_kv_blocks=9, num_state_slots=3, max_num_batched_tokens=5
)
SMALL_XLA = dict(max_num_seqs=4, max_num_batched_tokens=32)  # few buckets: quick compiles


def _inputs(t: int, h: int, dk: int, dv: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = gdn_ops.l2norm(torch.randn(t, h, dk, generator=g)) * dk**-0.5
    k = gdn_ops.l2norm(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    gate = -torch.nn.functional.softplus(torch.randn(t, h, generator=g))
    beta = torch.sigmoid(torch.randn(t, h, generator=g))
    return q, k, v, gate, beta, torch.randn(h, dk, dv, generator=g)


def test_torch_reference_forms_agree() -> None:
    T, H, dk, dv = 13, 3, 4, 5
    q, k, v, g, beta, h0 = _inputs(T, H, dk, dv)
    y, hT = gdn_ops.gated_delta_rule(q, k, v, g, beta, h0)
    h = h0.clone()  # the definition, written out once more
    for t in range(T):
        h = h * torch.exp(g[t])[:, None, None]
        err = v[t] - torch.einsum("hk,hkv->hv", k[t], h)
        h = h + torch.einsum("hk,hv->hkv", k[t], err * beta[t][:, None])
        torch.testing.assert_close(y[t], torch.einsum("hk,hkv->hv", q[t], h))
    yc, hc = gdn_ops.gated_delta_rule_chunked(q, k, v, g, beta, h0, chunk=4)
    torch.testing.assert_close(yc, y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hc, hT, rtol=1e-4, atol=1e-4)
    ys, hs = [], h0
    for lo, hi in [(0, 5), (5, 6), (6, 13)]:
        yy, hs = gdn_ops.gated_delta_rule_chunked(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi],
                                                  beta[lo:hi], hs, chunk=4)  # fmt: skip
        ys.append(yy)
    torch.testing.assert_close(torch.cat(ys), y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hs, hT, rtol=1e-4, atol=1e-4)
    _, h12 = gdn_ops.gated_delta_rule(q[:12], k[:12], v[:12], g[:12], beta[:12], h0)
    y1, h1 = gdn_ops.gated_delta_rule_step(h12[None], q[12:13], k[12:13], v[12:13], g[12:13],
                                           beta[12:13])  # fmt: skip
    torch.testing.assert_close(y1[0], y[12], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1[0], hT, rtol=1e-5, atol=1e-5)


def test_hf_reference_matches() -> None:
    """Our sequential rule = transformers' own torch_recurrent_gated_delta_rule (which l2-normalises
    and scales q / k itself)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    g0 = torch.Generator().manual_seed(3)
    T, H, dk, dv = 9, 2, 8, 4
    q, k = torch.randn(1, T, H, dk, generator=g0), torch.randn(1, T, H, dk, generator=g0)
    v = torch.randn(1, T, H, dv, generator=g0)
    g = -torch.rand(1, T, H, generator=g0)
    beta = torch.rand(1, T, H, generator=g0)
    h0 = torch.randn(1, H, dk, dv, generator=g0)
    want, want_h = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    qn, kn = gdn_ops.l2norm(q[0]) * dk**-0.5, gdn_ops.l2norm(k[0])
    y, h = gdn_ops.gated_delta_rule(qn, kn, v[0], g[0], beta[0], h0[0])
    torch.testing.assert_close(y, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, want_h[0], rtol=1e-5, atol=1e-5)


def _generate(llm, prompts=PROMPTS) -> list[list[int]]:  # noqa: ANN001
    from xlaserve import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


def test_spec_and_cache_kinds(ssm_model_dir) -> None:  # noqa: ANN001
    from xlaserve.model_loader.registry import build_spec
    from xlaserve.model_loader.ssm import cache_layout, is_state_model, state_shapes

    spec = build_spec(ssm_model_dir("qwen3_next"))
    assert spec.extra["layer_kinds"] == ["gdn", "attention", "gdn", "attention"]
    assert is_state_model(spec)
    # conv channels q | k | v = 2 * 2 * 16 + 4 * 8; state [Hv, dk, dv] = [4, 16, 8].
    assert state_shapes(spec) == ((96, 3), (4, 16, 8))
    assert cache_layout(spec, 4, 4).kinds == ("attention", "recurrent_state")
    assert spec.is_moe_layer(1) and not spec.is_moe_layer(0)


def test_greedy_matches_transformers_torch(ssm_model_dir, caplog) -> None:  # noqa: ANN001
    from xlaserve import LLM

    path = ssm_model_dir("qwen3_next")
    want = hf_greedy(path, PROMPTS, MAX_NEW)
    assert len({t for seq in want for t in seq}) > 3, f"degenerate greedy output {want}"
    with caplog.at_level(logging.INFO, logger="xlaserve.core.kv_cache_manager"):
        llm = LLM(path, backend="torch", dtype="float32", block_size=4, max_model_len=64)
    assert "prefix caching is disabled" in caplog.text
    assert _generate(llm) == want


def test_greedy_under_pressure_torch(ssm_model_dir) -> None:  # noqa: ANN001
    """Token budget 5 (prompts prefilled in chunks), 3 state slots for 4 sequences, 9 blocks of 4:
    admission waits for slots, running requests preempt (and are recomputed from token 0)."""
    from xlaserve import LLM

    path = ssm_model_dir("qwen3_next")
    want = hf_greedy(path, PROMPTS, MAX_NEW)
    llm = LLM(path, backend="torch", dtype="float32", **PRESSURE)
    assert _generate(llm) == want
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0


def test_triton_kernels_in_engine(ssm_model_dir) -> None:  # noqa: ANN001
    """triton_ops="on": decode steps run kernels_cuda/gdn.py + ssm.conv_state_update in place,
    prefill chunks the chunked Triton kernel (the interpreter on the CPU); tokens still equal
    transformers', also under the tight cache."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from xlaserve import LLM

    path = ssm_model_dir("qwen3_next")
    want = hf_greedy(path, PROMPTS, MAX_NEW)
    llm = LLM(path, backend="torch", dtype="float32", triton_ops="on",
              attention_backend="torch_batched", **PRESSURE)  # fmt: skip
    mixers = [m for m in llm.llm_engine.core.runner.model.modules() if hasattr(m, "triton")]
    assert mixers and all(m.triton for m in mixers)
    assert _generate(llm) == want


def test_speculative_decoding_refused(ssm_model_dir) -> None:  # noqa: ANN001
    from xlaserve import LLM

    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        LLM(ssm_model_dir("qwen3_next"), backend="torch", max_model_len=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})  # fmt: skip


def test_structured_output_choice(ssm_model_dir) -> None:  # noqa: ANN001
    pytest.importorskip("xgrammar")
    from xlaserve import LLM, SamplingParams
    from xlaserve.sampling_params import StructuredOutputsParams

    llm = LLM(ssm_model_dir("qwen3_next"), backend="torch", dtype="float32", max_model_len=64)
    so = StructuredOutputsParams(choice=["light", "darkness"])
    out = llm.generate(
        ["And God said"], SamplingParams(max_tokens=8, structured_outputs=so), use_tqdm=False
    )
    assert out[0].outputs[0].text in ("light", "darkness")


# ---- XLA backend -------------------------------------------------------------------------------


def test_jnp_references_match_torch() -> None:
    """jnp sequential / chunked / ragged forms = the torch sequential recurrence; the ragged step
    (fresh 5-token row, a 3-token row continuing a state, a 1-token decode, a padding row)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from xlaserve.models_flax import gdn_ops as jops
    from xlaserve.models_flax import ssm_ops

    q, k, v, g, beta, h0 = _inputs(13, 3, 4, 5, seed=1)
    want_y, want_h = gdn_ops.gated_delta_rule(q, k, v, g, beta, h0)
    args = [jnp.asarray(a.numpy()) for a in (q, k, v, g, beta, h0)]
    for fn in (jops.gated_delta_rule, lambda *a: jops.gated_delta_rule_chunked(*a, chunk=4)):
        y, h = fn(*args)
        np.testing.assert_allclose(np.asarray(y), want_y.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(h), want_h.numpy(), rtol=1e-4, atol=1e-4)
    R, T = 4, 12
    cu = np.array([0, 5, 8, 9, 9], np.int32)
    kv_lens = np.array([5, 10, 21, 0], np.int32)
    lay = ssm_ops.row_layout(jnp.asarray(cu), jnp.asarray(kv_lens), T)
    q, k, v, g, beta, _ = _inputs(T, 3, 4, 5, seed=2)
    hs0 = torch.randn(R, 3, 4, 5, generator=torch.Generator().manual_seed(5))
    hs0[0] = 0.0  # row 0 is fresh
    jargs = [jnp.asarray(a.numpy()) for a in (q, k, v, g, beta, hs0)]
    forms = {
        "sequential": jops.ragged_gated_delta_rule,
        # chunk 2: rows of 5 and 3 tokens take several chunks, the last one partial.
        "chunked": lambda *a: jops.ragged_gated_delta_rule_chunked(*a, chunk=2),
        "chunked-64": jops.ragged_gated_delta_rule_chunked,  # one chunk of min(64, T) tokens
    }
    for form, fn in forms.items():
        y, hs = fn(*jargs, lay, jnp.asarray(cu))
        for r in range(3):
            lo, hi = cu[r], cu[r + 1]
            yr, hr = gdn_ops.gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                              hs0[r])  # fmt: skip
            np.testing.assert_allclose(np.asarray(y[lo:hi]), yr.numpy(), rtol=1e-4, atol=1e-4,
                                       err_msg=form)  # fmt: skip
            np.testing.assert_allclose(np.asarray(hs[r]), hr.numpy(), rtol=1e-4, atol=1e-4,
                                       err_msg=form)  # fmt: skip
        # the padding row's state is untouched
        np.testing.assert_allclose(np.asarray(hs[3]), hs0[3].numpy(), rtol=1e-6, atol=1e-6)
    # A decode step (one token per row, a padding row): the chunked form's one-token branch.
    cu1 = np.array([0, 1, 2, 3, 3], np.int32)
    lay1 = ssm_ops.row_layout(jnp.asarray(cu1), jnp.asarray([6, 2, 9, 0], np.int32), T)
    y, hs = jops.ragged_gated_delta_rule_chunked(*jargs, lay1, jnp.asarray(cu1))
    for r in range(3):
        yr, hr = gdn_ops.gated_delta_rule(q[r : r + 1], k[r : r + 1], v[r : r + 1],
                                          g[r : r + 1], beta[r : r + 1], hs0[r])  # fmt: skip
        np.testing.assert_allclose(np.asarray(y[r]), yr[0].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(hs[r]), hr.numpy(), rtol=1e-5, atol=1e-5)


def test_greedy_matches_transformers_xla(ssm_model_dir) -> None:  # noqa: ANN001
    pytest.importorskip("jax")
    from xlaserve import LLM

    path = ssm_model_dir("qwen3_next")
    want = hf_greedy(path, PROMPTS, MAX_NEW)
    llm = LLM(path, backend="xla", dtype="float32", block_size=4, max_model_len=64, **SMALL_XLA)
    assert _generate(llm) == want


def test_greedy_under_pressure_xla(ssm_model_dir) -> None:  # noqa: ANN001
    """Token budget 16 (the 23-token prompt is chunked), 3 state slots, 9 blocks of 4."""
    pytest.importorskip("jax")
    from xlaserve import LLM

    path = ssm_model_dir("qwen3_next")
    want = hf_greedy(path, PROMPTS, MAX_NEW)
    llm = LLM(
        path, backend="xla", dtype="float32", block_size=4, max_model_len=32, num_kv_blocks=9,
        num_state_slots=3, max_num_seqs=4, max_num_batched_tokens=16,
    )  # fmt: skip
    assert _generate(llm) == want
    assert llm.llm_engine.get_stats().num_preemptions_total > 0
