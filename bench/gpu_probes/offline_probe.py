#!/usr/bin/env python
"""GPU probe behind bench/RESULTS.md "fourth session", calls 1, 3 and 5: Triton compiles and step
times of the offline 256 / 256 benchmark, first run against second run in one process.

    OUT=dir python bench/gpu_probes/offline_probe.py [NUM_PROMPTS]   # -> $OUT/probe.json

Llama-3.1-8B shape, dummy bf16 weights, the gpu_bench engine settings. A hook on Triton's
`JITFunction._do_compile` records every compile with its phase (init / run1 / run2); a hook on
`Scheduler.schedule` times each step of run1 (prefill vs decode split, slowest steps). Run2
repeats run1's prompts, so the prefix cache serves them: its throughput is not a benchmark
figure. Calls 1 and 3 ran earlier versions of this script (without the step timing; call 1 also
profiled a third run with cProfile).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from triton.runtime import jit as triton_jit

from xlaserve.bench import gpu_bench as gb

PHASE = ["init"]
COMPILES: list[dict[str, Any]] = []
_orig_compile = triton_jit.JITFunction._do_compile


def _counting_compile(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    t = time.perf_counter()
    out = _orig_compile(self, *args, **kwargs)
    COMPILES.append(
        {"fn": self.fn.__name__, "phase": PHASE[0], "s": round(time.perf_counter() - t, 3),
         "key": str(args[0])[:400]}
    )  # fmt: skip
    return out


def main() -> None:
    triton_jit.JITFunction._do_compile = _counting_compile
    from xlaserve import LLM

    out_dir = os.environ.get("OUT", "/tmp")
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    model_dir = gb.write_model_dir("/tmp/llama8b", 32)
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", max_num_seqs=256,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.9)  # fmt: skip
    res: dict[str, Any] = {"init_s": time.perf_counter() - t0}
    sched = llm.llm_engine.scheduler
    steps: list[tuple[float, int, int]] = []  # (time, scheduled tokens, requests)
    inner = sched.schedule

    def timed_schedule(*a, **k):  # noqa: ANN002, ANN003, ANN202
        so = inner(*a, **k)
        steps.append((time.perf_counter(), so.total_num_scheduled_tokens,
                      len(so.num_scheduled_tokens)))  # fmt: skip
        return so

    sched.schedule = timed_schedule
    for phase in ("run1", "run2"):
        PHASE[0] = phase
        st0 = torch.cuda.memory_stats()
        r = gb._offline(llm, n, 256, 256, 1, gb.LLAMA_8B["vocab_size"])
        st1 = torch.cuda.memory_stats()
        r["allocs"] = {k: st1.get(k, 0) - st0.get(k, 0)
                       for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}  # fmt: skip
        # A step's time: from its schedule to the next one's (async: one step ahead).
        gaps = [(steps[i + 1][0] - steps[i][0], steps[i][1], steps[i][2])
                for i in range(len(steps) - 1)]  # fmt: skip
        pre = [g for g, t, b in gaps if t > b]
        dec = [g for g, t, b in gaps if t == b]
        r["prefill_steps"] = (len(pre), round(sum(pre), 2))
        r["decode_steps"] = (len(dec), round(sum(dec), 2))
        r["slowest_steps_ms"] = [(round(1e3 * g, 1), t, b) for g, t, b in sorted(gaps)[::-1][:25]]
        steps.clear()
        res[phase] = r
        print(phase, r["output_tokens_per_s"], r["per_step_ms"], "prefill", r["prefill_steps"],
              "decode", r["decode_steps"], flush=True)  # fmt: skip
    res["compiles"] = COMPILES
    with open(os.path.join(out_dir, "probe.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print("compiles:", [(c["fn"], c["phase"], c["s"]) for c in COMPILES])


if __name__ == "__main__":
    main()
