"""Tensor parallelism on 4 forced host devices: tp 2 (KV heads sharded, attention under
shard_map) and tp 4 (2 KV heads < 4 devices: KV replicated, GSPMD) give tp 1's greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from tiny_models import hf_greedy


def test_tensor_parallel_matches_single_device(tiny_model_dir, jax_cache_dir) -> None:  # noqa: ANN001
    path = tiny_model_dir("llama")
    worker = os.path.join(os.path.dirname(__file__), "tp_worker.py")
    proc = subprocess.run(
        [sys.executable, worker, path, jax_cache_dir, "1,2,4"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["1"]["tokens"] == res["2"]["tokens"] == res["4"]["tokens"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 384, n).tolist() for n in (7, 20, 3)]
    assert res["1"]["tokens"] == hf_greedy(path, prompts, 6)
    assert res["2"]["devices"] == 2 and res["4"]["devices"] == 4
    assert res["2"]["q_spec"] == res["4"]["q_spec"] == ["model", None]  # split on the output axis
    assert res["2"]["kv_spec"][:3] == [None, None, "model"]  # KV heads split
    assert "model" not in res["4"]["kv_spec"]  # replicated: 2 KV heads cannot split 4 ways
