"""Run in a subprocess by test_tensor_parallel.py: XLA_FLAGS must be set before jax is imported.

argv: model_dir cache_dir tp[,tp...]  -> prints one JSON line {tp: {"tokens", "q_spec", "kv_spec"}}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from xla_helpers import drive, make_runner  # noqa: E402

from xlaserve.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    path, cache_dir, tps = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 384, n).tolist() for n in (7, 20, 3)]
    result = {}
    for tp in tps:
        runner = make_runner(path, cache_dir, tensor_parallel_size=tp, enforce_eager=True,
                             max_num_batched_tokens=16, max_num_seqs=2)  # fmt: skip
        got, _, _ = drive(runner, prompts, SamplingParams(temperature=0.0), 6, budget=16)
        q = runner.state["layers"][0]["self_attn"]["q_proj"]["weight"].get_value()
        result[tp] = dict(
            tokens=got,
            q_spec=list(q.sharding.spec),
            kv_spec=list(runner.kv_caches[0][0].sharding.spec),
            devices=len(q.sharding.device_set),
        )
        runner.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
