"""Torch tensor parallelism on the CPU (gloo): TP 2 with two processes (rank 0 in this process,
rank 1 spawned) gives TP 1's greedy tokens, on a GQA Llama (4 q heads / 2 kv heads, untied head)
and a Qwen2 (qkv bias, tied embeddings); the KV cache of each rank holds only its KV heads."""

from __future__ import annotations

import time

import numpy as np
import pytest

from xlaserve.config import EngineConfig
from xlaserve.engine.llm_engine import LLMEngine
from xlaserve.sampling_params import SamplingParams


def _config(path: str, tp: int, **kw: object) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=path,
        backend="torch",
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=48,  # long prompts are prefilled in chunks
        tensor_parallel_size=tp,
        **kw,
    )


def _greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tp2_matches_tp1_greedy(tiny_model_dir, kind: str) -> None:  # noqa: ANN001
    from xlaserve.backends_torch.distributed import parallel_state as ps
    from xlaserve.backends_torch.distributed.executor import MultiprocExecutor

    path = tiny_model_dir(kind)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 384, n).tolist() for n in (5, 70, 2)]
    ref_engine = LLMEngine(_config(path, 1))
    ref = _greedy(ref_engine, prompts, 6)
    ref_engine.shutdown()
    assert len({tuple(r) for r in ref}) > 1  # not one degenerate continuation

    t0 = time.perf_counter()
    engine = LLMEngine(_config(path, 2))
    try:
        ex = engine.runner
        assert isinstance(ex, MultiprocExecutor) and ex.world_size == 2
        assert ps.tp_world_size() == 2 and ps.tp_rank() == 0
        assert len(ex.workers) == 1 and ex.workers[0].is_alive()
        spec = engine.spec
        k0, _ = ex.runner.kv_caches[0]
        assert k0.shape[2] == spec.num_kv_heads // 2  # this rank's KV heads only
        qkv = ex.runner.model.layers[0].self_attn.qkv_proj  # this rank's q, k, v, fused
        assert type(qkv).__name__ == "MergedColumnParallelLinear"
        assert qkv.part_sizes == (spec.q_size // 2, spec.kv_size // 2, spec.kv_size // 2)
        out = _greedy(engine, prompts, 6)
        # Finished / aborted requests are forgotten by both ranks; the engine keeps serving.
        out2 = _greedy(engine, prompts[:1], 6)
    finally:
        engine.shutdown()
    print(f"tp2 {kind}: {time.perf_counter() - t0:.1f}s (start + 4 requests)")
    assert out == ref
    assert out2 == ref[:1]
    assert ps.get_tp_group() is None  # the process group was torn down
    assert ex.workers == []


def test_tp_rejects_indivisible_heads(tiny_model_dir) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLMEngine(_config(tiny_model_dir("llama"), 3))
