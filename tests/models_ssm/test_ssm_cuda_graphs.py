"""Decode CUDA graphs of recurrent-state models (backends_torch/cuda_graphs.py, issue 25).

CPU (any machine): no CUDA graphs exist, so the step runner's CPU stand-in runs, at each
"replay", the very forward a bucket's graph captures, over the same static buffers (state slots,
keep flags, padding rows on the scratch slot). The tests check that this decode path is the same
maths as the eager one, that padding rows and start-up (capture, warm-up) touch no slot but the
scratch one, and that greedy tokens through the engine are unchanged. Triton kernels run in the
interpreter (TRITON_INTERPRET=1, tests/conftest.py), as the graph's kernels on CUDA.

GPU (`pytest -m gpu tests/models_ssm/test_ssm_cuda_graphs.py -q`): for every state architecture
of the tiny zoo, greedy tokens with real CUDA graphs equal enforce_eager=True for a mixed-length
batch whose requests finish at different steps (buckets shrink and pad), and graphs really ran.
"""

from __future__ import annotations

import os

import pytest
import torch

from xlaserve import LLM, SamplingParams

needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs a GPU or TRITON_INTERPRET=1",
)

# Mixed lengths (one single-token prompt: its first step is decode-shaped and fresh) and
# different output lengths, so requests finish at different steps and buckets shrink / pad.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [40, 41, 42],
    list(range(100, 113)),
    [200],
    [7, 8],
]
MAX_TOKENS = [6, 2, 4, 5, 3]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _cpu_llm(path: str, triton_ops: str = "on", max_num_seqs: int = 4) -> LLM:
    """A CPU engine whose attention backend can build graph metadata (Triton, interpreted)."""
    return LLM(
        path, backend="torch", dtype="float32", block_size=4, max_model_len=64,
        max_num_seqs=max_num_seqs, attention_backend="triton", triton_ops=triton_ops,
    )  # fmt: skip


def _with_graph_step(llm: LLM):  # noqa: ANN202 - (runner, CudaStepRunner)
    """Give the engine's runner a step runner with (CPU-emulated) decode graphs, as
    init_kv_cache does on CUDA."""
    from xlaserve.backends_torch.cuda_graphs import make_cuda_step_runner

    runner = llm.llm_engine.core.runner
    assert runner.cuda_step is None  # the CPU runner has none of its own
    runner.cuda_step = make_cuda_step_runner(runner)
    return runner, runner.cuda_step


def _state_tensors(caches: list) -> list[torch.Tensor]:
    """Every recurrent-state tensor [slots + 1, ...] of the caches (nested: Falcon-H1)."""
    out: list[torch.Tensor] = []
    for c in caches:
        if isinstance(c, tuple) and isinstance(c[0], tuple):  # ((K, V), (conv, ssm))
            out.extend(t for t in c[1] if t.numel())
        elif isinstance(c, tuple) and c[0].dim() == 3 and c[0].dtype == torch.float32:
            out.extend(t for t in c if t.numel())  # (conv [S, C, K-1], ssm [S, ...])
    return out


def _all_tensors(caches: list) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for c in caches:
        out.extend(_all_tensors(list(c)) if isinstance(c, (tuple, list)) else [c])
    return out


@needs_triton
@pytest.mark.parametrize(
    "name,triton_ops",
    [("mamba2", "on"), ("mamba2", "off"), ("qwen3_next", "on"), ("lfm2", "on")],
)
def test_padded_replay_is_eager_maths_and_writes_only_scratch(
    name: str, triton_ops: str, ssm_model_dir
) -> None:  # noqa: ANN001
    """3 decode requests in bucket 4 (one padding row): the replayed forward gives the eager
    step's hidden states and live slots' states; every other slot, slot 0 included, is left
    bit-for-bit as it was (only the scratch slot may change). A padding row on slot 0 fails."""
    llm = _cpu_llm(ssm_model_dir(name), triton_ops)
    runner, step = _with_graph_step(llm)
    scratch = runner.state_scratch_slot()
    states = _state_tensors(runner.kv_caches)
    assert states and scratch == runner.num_state_slots() == 4
    assert all(t.shape[0] == scratch + 1 for t in states)  # the spare row exists
    assert step.state_scratch == scratch and sorted(step.graphs) == [1, 2, 4]
    # Start-up (capture's forwards, eager warm-up) wrote the scratch slot only.
    for t in states:
        assert not t[:scratch].any(), "start-up wrote a request's state slot"
    g = torch.Generator().manual_seed(0)
    for t in _all_tensors(runner.kv_caches):  # a live state in every slot, and some KV
        t.copy_(torch.randn(t.shape, generator=g) * 0.5)
    before = [t.clone() for t in _all_tensors(runner.kv_caches)]
    # Decode chunks: (token, position, block table); slots 3, 1, 2; the last one fresh (pos 0).
    chunks = [([11], 5, [1, 2]), ([22], 9, [3, 4, 5]), ([33], 0, [6])]
    state = ([3, 1, 2], [False, False, True])
    hidden_g = step.forward(chunks, None, state)[0].clone()
    assert step.num_replays == 1 and step.bucket_replays == {4: 1}
    after_g = [t.clone() for t in _all_tensors(runner.kv_caches)]
    # The eager path on the same starting caches.
    for t, b in zip(_all_tensors(runner.kv_caches), before, strict=True):
        t.copy_(b)
    graphs, step.graphs = step.graphs, {}
    hidden_e = step.forward(chunks, None, state)[0].clone()
    step.graphs = graphs
    assert step.num_replays == 1
    torch.testing.assert_close(hidden_g, hidden_e, rtol=1e-4, atol=1e-5)
    after_e = _all_tensors(runner.kv_caches)
    live = [3, 1, 2]
    for t, b, tg, te in zip(_all_tensors(runner.kv_caches), before, after_g, after_e, strict=True):
        if not any(t is s for s in states):  # KV: the same writes
            torch.testing.assert_close(tg, te, rtol=1e-4, atol=1e-5)
            continue
        torch.testing.assert_close(tg[live], te[live], rtol=1e-4, atol=1e-5)
        assert not torch.equal(tg[live], b[live])  # the step did update them
        for s in range(scratch):
            if s not in live:  # slot 0 among them: padding must not touch it
                assert torch.equal(tg[s], b[s]), f"slot {s} was written by the graph path"


@needs_triton
@pytest.mark.parametrize("name", ["mamba2", "granitemoehybrid"])
def test_engine_tokens_with_graph_step_runner(name: str, ssm_model_dir) -> None:  # noqa: ANN001
    """Through the whole engine (real scheduler, state slots handed out and freed): the step
    runner's replayed decode steps give the tokens of the plain CPU runner, in several buckets."""
    path = ssm_model_dir(name)
    want = _generate(LLM(path, backend="torch", dtype="float32", block_size=4, max_model_len=64))
    llm = _cpu_llm(path, max_num_seqs=8)
    _, step = _with_graph_step(llm)
    assert _generate(llm) == want
    assert step.num_replays > 0 and step.num_eager > 0  # decode replayed, prefill eager
    assert len(step.bucket_replays) >= 3, step.bucket_replays  # buckets shrank as requests ended


def test_fill_state_rows_pads_on_scratch() -> None:
    import numpy as np

    from xlaserve.backends_torch.cuda_graphs import fill_state_rows

    slots, keep = np.full(8, -7, np.int32), np.full(8, -7, np.int32)
    fill_state_rows(slots, keep, ([4, 0, 2], [False, True, False]), 4, scratch=9)
    assert slots.tolist() == [4, 0, 2, 9, -7, -7, -7, -7]  # rows past the bucket untouched
    assert keep.tolist() == [1, 0, 1, 0, -7, -7, -7, -7]
    with pytest.raises(ValueError, match="for a bucket of 2"):
        fill_state_rows(slots, keep, ([1, 2, 3], [False] * 3), 2, scratch=9)


def test_state_model_step_needs_state(ssm_model_dir) -> None:  # noqa: ANN001
    """The step runner refuses a state model's step without its slots (and vice versa)."""
    pytest.importorskip("triton")
    llm = _cpu_llm(ssm_model_dir("mamba2"), triton_ops="off")
    from xlaserve.backends_torch.cuda_graphs import CudaStepRunner

    runner = llm.llm_engine.core.runner
    step = CudaStepRunner(
        runner.model, runner.kv_caches, hidden_size=runner.spec.hidden_size, dtype=runner.dtype,
        block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
        num_kv_heads=1, num_heads=1, use_graphs=False, attn_backend=runner.attn_backend,
        device=runner.device, state_scratch_slot=runner.state_scratch_slot(),
    )  # fmt: skip
    with pytest.raises(ValueError, match="need the step's state slots"):
        step.forward([([1], 0, [0])])


def test_scratch_slot_is_paid_out_of_the_cache_budget(ssm_model_dir) -> None:  # noqa: ANN001
    """A budget of exactly 3 state slots: one goes to the scratch slot, 2 to requests; the
    state tensors hold 3 rows (memory.py's byte count walks nested caches too)."""
    from xlaserve.backends_torch.memory import _nbytes
    from xlaserve.model_loader.ssm import cache_layout

    path = ssm_model_dir("mamba2")
    probe = LLM(path, backend="torch", dtype="float32", block_size=4, max_model_len=64)
    runner = probe.llm_engine.core.runner
    per_slot = cache_layout(runner.spec, 4, 4).bytes_per_slot
    assert _nbytes(runner.kv_caches) == (runner.num_state_slots() + 1) * per_slot
    llm = LLM(
        path, backend="torch", dtype="float32", block_size=4, max_model_len=64,
        max_num_seqs=8, cpu_kv_cache_bytes=3 * per_slot,
    )  # fmt: skip
    runner = llm.llm_engine.core.runner
    assert runner.num_state_slots() == 2 and runner.state_scratch_slot() == 2
    assert llm.llm_engine.core.kv_manager.num_state_slots == 2
    assert all(t.shape[0] == 3 for t in _state_tensors(runner.kv_caches))
    assert _nbytes(runner.kv_caches) == 3 * per_slot
    assert _generate(llm) == _generate(probe)  # 5 requests through 2 slots: same tokens


GPU_ARCHS = [
    "mamba", "mamba2", "bamba", "granitemoehybrid", "jamba", "qwen3_next", "lfm2", "lfm2_moe",
    "falcon_h1", "nemotron_h",
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_ARCHS)
def test_cuda_graphs_match_enforce_eager(name: str, ssm_model_dir) -> None:  # noqa: ANN001
    """H200: decode steps replay real CUDA graphs (async scheduling feeds PENDING inputs on the
    device) and give the greedy tokens of enforce_eager=True; 7 requests in buckets of 8, 4, 2,
    1 as they finish."""
    prompts = [[(7 * i + j) % 300 + 3 for j in range(1 + 3 * i)] for i in range(7)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(7)]  # fmt: skip
    got = {}
    for eager in (False, True):
        llm = LLM(
            ssm_model_dir(name), backend="torch", dtype="float32", block_size=16,
            max_model_len=128, max_num_seqs=8, num_kv_blocks=128, enforce_eager=eager,
        )  # fmt: skip
        step = llm.llm_engine.core.runner.cuda_step
        assert step is not None and step.state_scratch is not None
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got[eager] = [o.outputs[0].token_ids for o in outs]
        if eager:
            assert not step.graphs and step.num_replays == 0
        else:
            assert sorted(step.graphs) == [1, 2, 4, 8]
            assert step.num_replays > 0, "decode steps did not replay graphs"
            assert len(step.bucket_replays) >= 3, step.bucket_replays
        llm.llm_engine.shutdown()
        torch.cuda.empty_cache()
    assert [len(t) for t in got[False]] == [3 + 2 * i for i in range(7)]
    assert got[False] == got[True]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bamba", "falcon_h1"])
def test_cuda_graphs_with_profiled_cache(name: str, ssm_model_dir) -> None:  # noqa: ANN001
    """No num_kv_blocks: the cache budget comes from profiling the GPU (Falcon-H1's nested
    caches counted), the scratch slot is paid out of it, and decode steps replay graphs."""
    llm = LLM(
        ssm_model_dir(name), backend="torch", dtype="float32", block_size=16, max_model_len=128,
        max_num_seqs=8, gpu_memory_utilization=0.2,
    )  # fmt: skip
    runner = llm.llm_engine.core.runner
    assert runner.num_state_slots() == 8 and runner.state_scratch_slot() == 8
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == MAX_TOKENS
    assert runner.cuda_step.num_replays > 0
    llm.llm_engine.shutdown()
    torch.cuda.empty_cache()
