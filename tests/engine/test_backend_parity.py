"""Backend parity through the real engine: backend "xla" gives the greedy tokens of backend
"torch" and of transformers, on every tiny Llama-family model (mixed-length batch), under
preemption, with prefix caching on and off, with chunked prefill, and on the shipped demo model.

Small buckets (max_num_batched_tokens 32, max_num_seqs 8) and one persistent compilation cache
for the session keep the XLA compiles few: the sampler programs of the tiny models are identical
HLO, so after the first model they come from the cache.
"""

from __future__ import annotations

import pytest
from tiny_models import hf_greedy

from xlaserve import LLM, SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 9, 10],
    [40, 41, 42],
    list(range(100, 137)),  # longer than the token budget: prefilled in chunks
    [7] * 20 + [8, 9],
    [200],
]
MAX_NEW = 10
BASE = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
_HF: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("jax-parity-cache"))


def _hf(path: str) -> list[list[int]]:
    if path not in _HF:
        _HF[path] = hf_greedy(path, PROMPTS, MAX_NEW)
    return _HF[path]


def _run(
    path: str,
    backend: str,
    cache: str,
    prompts: list[list[int]] = PROMPTS,
    rounds: int = 1,
    **kw: object,
):  # noqa: ANN202 - fmt: skip
    """Greedy tokens of `prompts` on `backend` (generated `rounds` times on one engine: later
    rounds can hit the prefix cache), and the engine's final stats."""
    args = {**BASE, "num_kv_blocks": 128, **kw}
    llm = LLM(path, backend=backend, compilation_cache_dir=cache, **args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = []
    for _ in range(rounds):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got.append([o.outputs[0].token_ids for o in outs])
    stats = llm.llm_engine.get_stats()
    llm.llm_engine.shutdown()
    assert all(g == got[0] for g in got)  # a cached prefix never changes the tokens
    return got[0], stats


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "llama3"])
def test_xla_matches_torch_and_transformers(tiny_model_dir, compile_cache: str, kind: str) -> None:  # noqa: ANN001
    path = tiny_model_dir(kind)
    xla, _ = _run(path, "xla", compile_cache)
    torch_, _ = _run(path, "torch", compile_cache)
    ref = _hf(path)
    assert xla == ref
    assert torch_ == ref
    assert len({tuple(t) for t in ref}) > 1  # the batch's rows really differ


@pytest.mark.parametrize(
    "kwargs",
    [
        # 14 blocks of 4 tokens cannot hold the batch: preemption by recompute.
        dict(num_kv_blocks=14, max_model_len=56),
        dict(num_kv_blocks=14, max_model_len=56, enable_prefix_caching=False),
        # a token budget of 8: every prompt but the shortest is prefilled in chunks; the batch is
        # served twice, the second time from cached prefix blocks.
        dict(max_num_batched_tokens=8, rounds=2),
    ],
    ids=["preempt", "preempt-nocache", "chunked-prefix-hits"],
)
def test_xla_parity_under_scheduler_pressure(
    tiny_model_dir, compile_cache: str, kwargs: dict
) -> None:  # noqa: ANN001
    path = tiny_model_dir("llama")
    xla, stats = _run(path, "xla", compile_cache, **kwargs)
    torch_, _ = _run(path, "torch", compile_cache, **kwargs)
    assert xla == torch_ == _hf(path)
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    if kwargs.get("num_kv_blocks") == 14:
        assert stats.num_preemptions_total > 0
    if kwargs.get("rounds") == 2:
        assert stats.prefix_cache_hits >= 36  # at least the 9 full blocks of the 37-token prompt


def test_demo_model_xla_matches_torch(compile_cache: str) -> None:
    from xlaserve.demo import demo_model_path

    path = demo_model_path()
    prompts = [[5, 17, 99, 400, 12], [31, 32], list(range(300, 320))]
    kw = dict(max_num_batched_tokens=16, max_num_seqs=2, max_model_len=64)
    xla, _ = _run(path, "xla", compile_cache, prompts=prompts, **kw)
    torch_, _ = _run(path, "torch", compile_cache, prompts=prompts, **kw)
    assert xla == torch_
    assert all(len(t) == MAX_NEW for t in xla)
