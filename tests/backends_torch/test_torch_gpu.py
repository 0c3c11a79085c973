"""The same runner on an NVIDIA GPU (torch_ref attention): parity with HF and bf16 smoke."""

from __future__ import annotations

import pytest
import torch
from test_torch_runner import MiniScheduler, _hf_greedy, _prompts, _runner
from torch_hf_models import load_hf

from xlaserve.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.mark.parametrize("name", ["llama", "qwen3_sw"])
def test_gpu_greedy_matches_hf(name: str, hf_model_dir) -> None:
    d = hf_model_dir(name)
    runner = _runner(d)
    assert runner.device.type == "cuda" and runner.kv_caches[0][0].is_cuda
    hf = load_hf(d)
    sched = MiniScheduler(runner, budget=16)
    prompts = _prompts(runner.spec.vocab_size)
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, SamplingParams(temperature=0.0, logprobs=2), max_tokens=6)
    sched.add("s", prompts[0], SamplingParams(temperature=0.8, top_p=0.9, seed=3), max_tokens=6)
    sched.run()
    for i, p in enumerate(prompts):
        assert sched.done[f"r{i}"].output == _hf_greedy(hf, p, 6)


def test_gpu_bf16_and_profiled_blocks(hf_model_dir) -> None:
    d = hf_model_dir("llama_bf16")
    runner = _runner(d, dtype="auto", num_kv_blocks=None, cache=dict(gpu_memory_utilization=0.05))
    assert runner.dtype == torch.bfloat16
    assert runner.num_blocks > 1000  # 5% of a large GPU holds many tiny blocks
    sched = MiniScheduler(runner, num_blocks=256, budget=16)
    for i, p in enumerate(_prompts(runner.spec.vocab_size)):
        sched.add(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens=4)
    sched.run()
    assert all(len(r.output) == 4 for r in sched.done.values())
