"""Does XLA wrap the forward in command buffers (its CUDA graphs)? Builds the demo model on
backend "xla" and counts, in the optimized HLO of the smallest forward program, the command
buffer computations, custom calls (Pallas kernels) and fusions; also times the host dispatch of
that program (non-blocking call) against its blocked latency.

    python -m xlaserve.bench.gpu_probes.xla_hlo_check
"""

from __future__ import annotations

import json
import os
import time


def main() -> None:
    from jax._src import xla_bridge

    from xlaserve import LLM
    from xlaserve.backends_xla.programs import FORWARD

    llm = LLM(os.path.join(os.path.dirname(__file__), "..", "..", "src", "xlaserve", "assets",
                           "demo-kjv"), backend="xla", max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=256)  # fmt: skip
    print(
        "XLA_FLAGS after start:", os.environ.get("XLA_FLAGS"), xla_bridge.backends_are_initialized()
    )
    r = llm.llm_engine.runner
    prog = r.programs[(FORWARD, 16)]
    text = prog.as_text()
    if os.environ.get("HLO_OUT"):  # keep the optimized HLO for reading
        with open(os.environ["HLO_OUT"], "w") as f:
            f.write(text)
    batch = r._dummy_batch(16)
    args = r._device_inputs(batch)
    out = prog(r.weights, r.kv_caches, *args)
    r.kv_caches = out[2]
    out[0].block_until_ready()
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        out = prog(r.weights, r.kv_caches, *args)
        r.kv_caches = out[2]
    t1 = time.perf_counter()
    out[0].block_until_ready()
    t2 = time.perf_counter()
    for _ in range(n):
        out = prog(r.weights, r.kv_caches, *args)
        r.kv_caches = out[2]
        out[0].block_until_ready()
    t3 = time.perf_counter()
    print(
        json.dumps(
            {
                "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                "command_buffer_mentions": text.count("command_buffer"),
                "custom_calls": text.count("custom-call"),
                "fusions": text.count(" fusion("),
                "dispatch_ms": 1e3 * (t1 - t0) / n,
                "pipelined_ms": 1e3 * (t2 - t0) / n,
                "blocked_ms": 1e3 * (t3 - t2) / n,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
