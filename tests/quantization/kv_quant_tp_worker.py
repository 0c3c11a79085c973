"""Run in a subprocess by test_kv_quant_xla.py (XLA_FLAGS must be set before jax is imported).

argv: model_dir cache_dir kv_cache_dtype tp[,tp...] -> prints one JSON line
{tp: {"tokens", "kv_spec", "scale_spec", "devices"}}: greedy tokens of the XLA runner with a
quantized KV cache on `tp` forced host devices, and the shardings of layer 0's codes and scales.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
)
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_TESTS, "backends_xla"))

import numpy as np  # noqa: E402
from xla_helpers import drive, make_runner  # noqa: E402

from xlaserve.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    path, cache_dir, kv, tps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 384, n).tolist() for n in (7, 20, 3)]
    result = {}
    for tp in [int(t) for t in tps.split(",")]:
        runner = make_runner(path, cache_dir, tensor_parallel_size=tp, enforce_eager=True,
                             max_num_batched_tokens=16, max_num_seqs=2, kv_cache_dtype=kv,
                             dtype="float32")  # fmt: skip
        got, _, _ = drive(runner, prompts, SamplingParams(temperature=0.0), 6, budget=16)
        k, _, ks, _ = runner.kv_caches[0]
        result[tp] = dict(
            tokens=got,
            kv_spec=list(k.sharding.spec),
            scale_spec=list(ks.sharding.spec),
            dtypes=[str(k.dtype), str(ks.dtype)],
            devices=len(k.sharding.device_set),
        )
        runner.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
