"""Triton attention backend + decode CUDA graphs in the Torch runner (GPU), and the pure helpers
of cuda_graphs (any machine)."""

from __future__ import annotations

import pytest
import torch
from test_torch_runner import MiniScheduler, _hf_greedy, _prompts, _runner
from torch_hf_models import load_hf

from xlaserve.sampling_params import SamplingParams

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_decode_buckets_and_splits() -> None:
    from xlaserve.backends_torch.cuda_graphs import decode_buckets, graph_kv_splits

    assert decode_buckets(1) == [1]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    # Llama-8B shape (8 kv heads, group 4) on 132 SMs: batch 1 splits, a full batch does not.
    assert graph_kv_splits(1, 8, 4, 132) == 16
    assert graph_kv_splits(256, 8, 4, 132) == 1
    s = graph_kv_splits(4, 8, 4, 132)
    assert s >= 1 and s & (s - 1) == 0


def test_graph_kv_splits_cap(monkeypatch) -> None:
    from xlaserve.backends_torch.cuda_graphs import graph_kv_splits

    monkeypatch.setenv("XLASERVE_GRAPH_MAX_KV_SPLITS", "8")
    assert graph_kv_splits(1, 8, 4, 132) == 8
    monkeypatch.setenv("XLASERVE_GRAPH_MAX_KV_SPLITS", "4")
    assert graph_kv_splits(1, 8, 4, 132) == 4


@pytest.mark.parametrize(
    "t,b,m,k", [(1, 1, 1, 0), (7, 3, 17, 2), (256, 256, 257, 256), (33, 5, 16, 5)]
)
def test_eager_layout_is_aligned_and_disjoint(t: int, b: int, m: int, k: int) -> None:
    """Every segment of the eager upload starts 16-int aligned (Triton specializes pointers on
    16-byte alignment) and the segments do not overlap."""
    from xlaserve.backends_torch.cuda_graphs import _eager_layout, _pad16

    mw = _pad16(m)
    assert mw % 16 == 0 and m <= mw < m + 16
    *offs, total = _eager_layout(t, b, mw, k)
    sizes = (t, t, t, b + 1, b, b * mw, k, k)
    assert all(o % 16 == 0 for o in offs)
    ends = [o + n for o, n in zip(offs, sizes, strict=True)]
    assert all(e <= nxt for e, nxt in zip(ends, offs[1:], strict=False))
    assert ends[-1] <= total


def _run(runner, prompts: list[list[int]], max_tokens: int = 8, budget: int = 16):
    sched = MiniScheduler(runner, num_blocks=runner.num_blocks, budget=budget)
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens=max_tokens)
    sched.run()
    return {rid: r.output for rid, r in sched.done.items()}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["llama", "qwen3_sw"])
def test_triton_graphs_match_hf_and_eager(name: str, hf_model_dir, monkeypatch) -> None:
    d = hf_model_dir(name)
    runner = _runner(d)
    assert runner.attn_backend_name == "triton"  # the CUDA default
    step = runner.cuda_step
    assert step is not None and step.graphs, "decode graphs were not captured"
    prompts = _prompts(runner.spec.vocab_size)
    out = _run(runner, prompts)
    assert step.num_replays > 0 and step.num_eager > 0  # prefill eager, decode replayed
    hf = load_hf(d)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == _hf_greedy(hf, p, 8)
    # Same tokens with graphs off, and with the torch reference attention.
    eager = _runner(d)
    eager.cuda_step.graphs.clear()
    assert _run(eager, prompts) == out and eager.cuda_step.num_replays == 0
    monkeypatch.setenv("XLASERVE_ATTENTION_BACKEND", "torch_ref")
    ref = _runner(d)
    assert ref.cuda_step is None
    assert _run(ref, prompts) == out


@pytest.mark.gpu
@needs_gpu
def test_graph_padding_and_long_context_bf16(hf_model_dir) -> None:
    """Batch sizes between buckets (padding), contexts over many blocks (split-KV), bf16."""
    d = hf_model_dir("llama_bf16")
    runner = _runner(d, dtype="auto", num_kv_blocks=256)
    assert runner.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    vocab = runner.spec.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 70, 41, 120, 9)]
    out = _run(runner, prompts, max_tokens=12, budget=64)
    assert runner.cuda_step.num_replays > 0
    runner2 = _runner(d, dtype="auto", num_kv_blocks=256)
    runner2.cuda_step.graphs.clear()
    out2 = _run(runner2, prompts, max_tokens=12, budget=64)
    # bf16: graph and eager run the same kernels on the same inputs -> identical tokens.
    assert out == out2
    assert all(len(v) == 12 for v in out.values())


@pytest.mark.gpu
@needs_gpu
def test_model_that_does_not_fit_raises(hf_model_dir) -> None:
    d = hf_model_dir("llama_bf16")
    with pytest.raises(RuntimeError, match="does not fit"):
        _runner(d, dtype="auto", num_kv_blocks=None, cache=dict(gpu_memory_utilization=0.001))


@pytest.mark.gpu
@needs_gpu
def test_no_triton_compiles_after_start_up(hf_model_dir, monkeypatch) -> None:
    """Start-up (profile forward, graph capture, warm-up) compiles every Triton specialisation a
    run of mixed batches needs: varied prompt lengths and batch sizes compile nothing more."""
    from triton.runtime import jit as triton_jit

    d = hf_model_dir("llama_bf16")
    runner = _runner(d, dtype="auto", num_kv_blocks=256)
    compiled: list[str] = []
    orig = triton_jit.JITFunction._do_compile

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        compiled.append(self.fn.__name__)
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(triton_jit.JITFunction, "_do_compile", counting)
    g = torch.Generator().manual_seed(1)
    vocab = runner.spec.vocab_size
    for batch, budget in ((1, 64), (3, 64), (17, 256), (5, 37)):
        lens = torch.randint(2, 90, (batch,), generator=g).tolist()
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
        _run(runner, prompts, max_tokens=5, budget=budget)
    assert runner.cuda_step.num_eager > 0 and runner.cuda_step.num_replays > 0
    assert compiled == [], f"Triton compiled during serving: {compiled}"
