"""Run in a subprocess by test_lora_tp.py: XLA_FLAGS must be set before jax is imported.

argv: model_dir cache_dir tp[,tp...] -> prints one JSON line {tp: tokens per request} for a
mixed batch of two adapters and the base model.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
)
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "backends_xla"))

from lora_helpers import PROMPTS, drive_lora, make_adapter  # noqa: E402
from xla_helpers import make_runner  # noqa: E402

from xlaserve.lora import LORA_MODULES  # noqa: E402


def main() -> None:
    path, cache_dir, tps = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
    result = {}
    for tp in tps:
        runner = make_runner(path, cache_dir, tensor_parallel_size=tp, enforce_eager=True,
                             max_num_batched_tokens=16, max_num_seqs=4, enable_lora=True,
                             max_loras=2, max_lora_rank=8)  # fmt: skip
        a1 = make_adapter(runner.spec, "a1", 1, 4, ("q_proj", "o_proj", "down_proj"), seed=1)
        a2 = make_adapter(runner.spec, "a2", 2, 8, LORA_MODULES, seed=2)
        result[tp] = dict(
            tokens=drive_lora(runner, PROMPTS, [0, -1, 1, 0], [(0, a1), (1, a2)], f"tp{tp}-"),
            impl=runner.lora_tables.impl,
        )
        runner.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
