"""Torch tensor parallelism through Ray (distributed_executor_backend="ray") on a local Ray
cluster: two rank actors over gloo give the same greedy tokens as TP 1. Skipped, with the
reason, when Ray is not installed."""

from __future__ import annotations

import numpy as np
from optional_deps import import_or_skip
from test_torch_tp import _config, _greedy

from xlaserve.engine.llm_engine import LLMEngine


def test_ray_tp2_matches_tp1(tiny_model_dir) -> None:  # noqa: ANN001
    ray = import_or_skip("ray")
    from xlaserve.backends_torch.distributed import parallel_state as ps
    from xlaserve.backends_torch.distributed.executor import RayExecutor

    path = tiny_model_dir("qwen2")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 384, n).tolist() for n in (6, 30)]
    ref_engine = LLMEngine(_config(path, 1))
    ref = _greedy(ref_engine, prompts, 6)
    ref_engine.shutdown()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engine = LLMEngine(_config(path, 2, distributed_executor_backend="ray"))
        try:
            assert isinstance(engine.runner, RayExecutor) and len(engine.runner.actors) == 2
            assert ps.get_tp_group() is None  # the driver is not a rank: every rank is an actor
            out = _greedy(engine, prompts, 6)
        finally:
            engine.shutdown()
    finally:
        ray.shutdown()
    assert out == ref
