"""Mamba / Mamba2 on the torch backend: the reference ops (chunks carry state exactly, the
chunked SSD and the single-step update equal the sequential scan) and greedy tokens through the
whole engine equal transformers' generate for a mixed-length batch, also under a tight cache that
forces chunked prefill and preemption (state slots freed and recomputed)."""

from __future__ import annotations

import logging

import pytest
import torch
from ssm_zoo import SSM_ARCHS, reference_greedy
from tiny_models import hf_greedy

from xlaserve.backends_torch.layers import ssm_ops

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [40, 41, 42],
    list(range(100, 123)),
    [200],
]
MAX_NEW = 6
GREEDY = dict(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g)


def test_conv1d_chunks_carry_state_and_update_matches() -> None:
    T, C, K = 11, 6, 4
    x, w, b = _rand(T, C), _rand(C, K), _rand(C)
    zero = torch.zeros(C, K - 1)
    whole, st_whole = ssm_ops.causal_conv1d(x, w, b, zero)
    # Against torch's own padded conv (the definition).
    ref = torch.nn.functional.conv1d(x.t()[None], w[:, None], b, padding=K - 1, groups=C)[0]
    torch.testing.assert_close(whole, ref[:, :T].t())
    ys, st = [], zero
    for lo, hi in [(0, 2), (2, 3), (3, 9), (9, 11)]:  # chunks, one of a single token
        y, st = ssm_ops.causal_conv1d(x[lo:hi], w, b, st)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys), whole)
    torch.testing.assert_close(st, st_whole)
    # Decode update over a batch of 2 identical states = the last step.
    _, st10 = ssm_ops.causal_conv1d(x[:10], w, b, zero)
    y1, st1 = ssm_ops.causal_conv1d_update(x[10:11].expand(2, C), w, b, st10.expand(2, C, K - 1))
    torch.testing.assert_close(y1[1], whole[10])
    torch.testing.assert_close(st1[0], st_whole)


@pytest.mark.parametrize("kind", ["mamba2", "mamba"])
def test_scan_chunks_ssd_and_step_agree(kind: str) -> None:
    T, Hs, P, N = 13, 4, 3, 5
    if kind == "mamba":  # per-channel A [Hs, 1, N], P = 1, B / C shared by channels
        P = 1
        A = -torch.exp(_rand(Hs, 1, N))
        B, C = _rand(T, 1, N), _rand(T, 1, N, seed=1)
    else:
        A = -torch.exp(_rand(Hs, 1, 1))
        B, C = _rand(T, Hs, N), _rand(T, Hs, N, seed=1)
    x, D = _rand(T, Hs, P), _rand(Hs)
    dt = torch.nn.functional.softplus(_rand(T, Hs, seed=2))
    h0 = _rand(Hs, P, N, seed=3)
    y, hT = ssm_ops.selective_scan(x, dt, A, B, C, D, h0)
    # Explicit recurrence, one step at a time (the definition).
    h = h0.clone()
    for t in range(T):
        h = (
            torch.exp(dt[t][:, None, None] * A) * h
            + dt[t][:, None, None] * x[t][..., None] * B[t][:, None]
        )
        torch.testing.assert_close(y[t], (h * C[t][:, None]).sum(-1) + D[:, None] * x[t])
    ys, hc = [], h0
    for lo, hi in [(0, 5), (5, 6), (6, 13)]:
        yc, hc = ssm_ops.selective_scan(x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], D, hc)
        ys.append(yc)
    torch.testing.assert_close(torch.cat(ys), y)
    torch.testing.assert_close(hc, hT)
    if kind == "mamba2":  # the chunked SSD form (chunk 4: several chunks + a partial one)
        ys2, hs2 = ssm_ops.ssd_chunked(x, dt, A, B, C, D, h0, chunk=4)
        torch.testing.assert_close(ys2, y, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hs2, hT, rtol=1e-4, atol=1e-4)
    _, h12 = ssm_ops.selective_scan(x[:12], dt[:12], A, B[:12], C[:12], D, h0)
    y1, h1 = ssm_ops.selective_state_update(
        h12[None], x[12:13], dt[12:13], A, B[12:13], C[12:13], D
    )
    torch.testing.assert_close(y1[0], y[12])
    torch.testing.assert_close(h1[0], hT)


def _generate(llm, prompts=PROMPTS) -> list[list[int]]:  # noqa: ANN001
    from xlaserve import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(SSM_ARCHS))
def test_greedy_matches_transformers(name: str, ssm_model_dir, caplog) -> None:  # noqa: ANN001
    from xlaserve import LLM

    path = ssm_model_dir(name)
    want = reference_greedy(name, path, PROMPTS, MAX_NEW)
    assert len({t for seq in want for t in seq}) > 3, f"degenerate greedy output {want}"
    with caplog.at_level(logging.INFO, logger="xlaserve.core.kv_cache_manager"):
        llm = LLM(path, backend="torch", dtype="float32", block_size=4, max_model_len=64)
    assert "prefix caching is disabled" in caplog.text
    assert _generate(llm) == want
    core = llm.llm_engine.core
    assert core.kv_manager.num_state_slots == core.config.scheduler.max_num_seqs


@pytest.mark.parametrize("name", list(SSM_ARCHS))
def test_greedy_under_pressure(name: str, ssm_model_dir) -> None:  # noqa: ANN001
    """Token budget 5 (prompts prefilled in chunks), 3 state slots for 4 sequences, 9 blocks of
    4 (one max-length request): admission waits for slots, running requests preempt."""
    from xlaserve import LLM

    path = ssm_model_dir(name)
    want = reference_greedy(name, path, PROMPTS, MAX_NEW)
    llm = LLM(
        path, backend="torch", dtype="float32", block_size=4, max_model_len=32,
        num_kv_blocks=9, num_state_slots=3, max_num_batched_tokens=5,
    )  # fmt: skip
    assert _generate(llm) == want
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0


def test_speculative_decoding_refused(ssm_model_dir) -> None:  # noqa: ANN001
    from xlaserve import LLM

    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        LLM(
            ssm_model_dir("mamba2"), backend="torch", max_model_len=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )  # fmt: skip


def test_structured_output_choice(ssm_model_dir) -> None:  # noqa: ANN001
    """Structured output masks logits only: it works unchanged on a state model."""
    pytest.importorskip("xgrammar")
    from xlaserve import LLM, SamplingParams
    from xlaserve.sampling_params import StructuredOutputsParams

    llm = LLM(ssm_model_dir("mamba2"), backend="torch", dtype="float32", max_model_len=64)
    so = StructuredOutputsParams(choice=["light", "darkness"])
    out = llm.generate(
        ["And God said"], SamplingParams(max_tokens=8, structured_outputs=so), use_tqdm=False
    )
    assert out[0].outputs[0].text in ("light", "darkness")


@pytest.mark.parametrize("name", ["mamba", "granitemoehybrid", "lfm2", "falcon_h1"])
def test_triton_decode_kernels_in_engine(name: str, ssm_model_dir) -> None:  # noqa: ANN001
    """triton_ops="on": decode steps run kernels_cuda/ssm.py (the Triton interpreter on the
    CPU, in place in the slot caches); tokens still equal transformers'."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from xlaserve import LLM

    path = ssm_model_dir(name)
    want = reference_greedy(name, path, PROMPTS[:2], MAX_NEW)
    llm = LLM(
        path, backend="torch", dtype="float32", block_size=4, max_model_len=64,
        triton_ops="on", attention_backend="torch_batched",
    )  # fmt: skip
    mixers = [m for m in llm.llm_engine.core.runner.model.modules() if hasattr(m, "triton")]
    assert mixers and all(m.triton for m in mixers)
    assert _generate(llm, PROMPTS[:2]) == want


@pytest.mark.parametrize("name", ["mamba2", "mamba", "bamba", "falcon_h1"])
def test_triton_prefill_kernels_in_engine(name: str, ssm_model_dir) -> None:  # noqa: ANN001
    """ssm_prefill_triton="on": prefill runs kernels_cuda/ssm_prefill.py (conv with state; the
    Mamba2 SSD scan), also in hybrids (Bamba, Falcon-H1's parallel layers), under chunked prefill
    (token budget 5) and preemption; greedy tokens equal the run with the switch off (the torch
    references)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from xlaserve import LLM

    path = ssm_model_dir(name)
    got = {}
    for mode in ("off", "on"):
        llm = LLM(
            path, backend="torch", dtype="float32", block_size=4, max_model_len=32,
            num_kv_blocks=9, num_state_slots=3, max_num_batched_tokens=5,
            ssm_prefill_triton=mode,
        )  # fmt: skip
        mixers = [m for m in llm.llm_engine.core.runner.model.modules() if hasattr(m, "triton")]
        assert mixers and all(m.prefill_triton == (mode == "on") for m in mixers)
        got[mode] = _generate(llm)
        assert llm.llm_engine.get_stats().num_preemptions_total > 0
    assert len({t for seq in got["off"] for t in seq}) > 3, f"degenerate output {got['off']}"
    assert got["on"] == got["off"]


def test_async_scheduling_under_pressure(ssm_model_dir) -> None:  # noqa: ANN001
    """Async scheduling (step N+1 scheduled before step N's tokens are back) with chunked
    prefill and preemption: state slots follow the requests; tokens equal transformers'."""
    from xlaserve import LLM

    path = ssm_model_dir("bamba")
    want = hf_greedy(path, PROMPTS, MAX_NEW)
    llm = LLM(
        path, backend="torch", dtype="float32", block_size=4, max_model_len=32,
        num_kv_blocks=9, num_state_slots=3, max_num_batched_tokens=5, async_scheduling="on",
    )  # fmt: skip
    assert llm.llm_engine.core._async
    assert _generate(llm) == want
    assert llm.llm_engine.get_stats().num_preemptions_total > 0
