"""The runner on a GPU (jax with CUDA): memory-profiled KV sizing and greedy parity with HF."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import hf_greedy
from xla_helpers import drive, make_runner

from xlaserve.sampling_params import SamplingParams


@pytest.mark.gpu
def test_runner_on_gpu(tiny_model_dir, jax_cache_dir) -> None:  # noqa: ANN001
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("jax has no GPU backend here")
    path = tiny_model_dir("qwen2")
    runner = make_runner(path, jax_cache_dir, load=False, num_kv_blocks=None, gpu_memory_utilization=0.3,
                         max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128)  # fmt: skip
    runner.load_model()
    n = runner.determine_num_kv_blocks()
    assert n > 1000  # a tiny model leaves most of 30% of the device to the cache
    runner.init_kv_cache(min(n, 4096))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 384, k).tolist() for k in (5, 40, 90, 9, 1, 33)]
    got, _, _ = drive(runner, prompts, SamplingParams(temperature=0.0), 8, budget=64)
    assert got == hf_greedy(path, prompts, 8)
