"""Run in a subprocess by test_xla_expert_parallel.py (XLA_FLAGS must be set before jax is
imported): 4 forced host devices.

argv: cache_dir name=model_dir[,name=model_dir...] -> prints one JSON line
{name: {n: {"tokens", "spec", "shard_rows", "devices"}}, "ragged_error": str} for n in 1, 2, 4
(n devices; expert parallelism on for n > 1).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "backends_xla"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from xla_helpers import drive, make_runner  # noqa: E402

from xlaserve.models_flax.moe import fused_experts_ep  # noqa: E402
from xlaserve.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    cache_dir = sys.argv[1]
    models = dict(item.split("=", 1) for item in sys.argv[2].split(","))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 384, n).tolist() for n in (7, 20, 3)]
    result: dict = {}
    for name, path in models.items():
        result[name] = {}
        for n in (1, 2, 4):
            runner = make_runner(path, cache_dir, tensor_parallel_size=n, enforce_eager=True,
                                 enable_expert_parallel=n > 1, max_num_batched_tokens=16,
                                 max_num_seqs=2)  # fmt: skip
            got, _, _ = drive(runner, prompts, SamplingParams(temperature=0.0), 6, budget=16)
            w = runner.state["layers"][0]["mlp"]["experts"]["w_gate"].get_value()
            result[name][n] = dict(
                tokens=got,
                spec=list(w.sharding.spec) + [None] * (w.ndim - len(w.sharding.spec)),
                shard_rows=sorted({s.data.shape[0] for s in w.addressable_shards}),
                devices=len(w.sharding.device_set),
                experts=w.shape[0],
            )
            runner.shutdown()
    # 3 devices cannot split 4 experts: a clear error, not a wrong answer.
    mesh = Mesh(np.array(jax.devices()[:3]), ("model",))
    z = jnp.zeros((4, 8, 8))
    try:
        fused_experts_ep(
            jnp.zeros((2, 8)), z, z, z, jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32), mesh
        )
        result["ragged_error"] = ""
    except ValueError as e:
        result["ragged_error"] = str(e)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
