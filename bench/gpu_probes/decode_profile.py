#!/usr/bin/env python
"""GPU probe: where a decode step of the offline benchmark spends its GPU time, at real context
lengths (the graph-replay profile in gpu_bench replays with whatever the last step left behind).

    OUT=dir python bench/gpu_probes/decode_profile.py MAX_NUM_SEQS MAX_NUM_BATCHED_TOKENS [N] [Q]
    # -> $OUT/decode_profile_<MAX_NUM_SEQS>[_<Q>].json; Q: LLM(quantization=Q), e.g. fp8,
    # or fp8_kv: LLM(kv_cache_dtype="fp8") with bf16 weights

Llama-3.1-8B shape, dummy bf16 weights, the gpu_bench engine settings except the two limits.
Runs the offline 256 / 256 benchmark over N prompts (default 1000) and, inside it, profiles
(torch.profiler, CUPTI: kernels inside CUDA graphs included) the 8 pure-decode steps that follow the first
wave's 128th decode step (contexts ~384 tokens), and the 3rd and 4th full prefill steps
(MAX_NUM_BATCHED_TOKENS tokens each). The profiler's start / stop run inside the timed run, so
this run's throughput is not a benchmark figure. Reports GPU time per step by kernel, the GPU
busy time per step against the wall time per step, and the host/device split of gpu_bench.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from xlaserve.bench import gpu_bench as gb

PROFILED_STEPS = 8
FIRST_PROFILED_DECODE = 128


def main() -> None:
    from xlaserve import LLM

    out_dir = os.environ.get("OUT", "/tmp")
    seqs, tokens = int(sys.argv[1]), int(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    quant = sys.argv[4] if len(sys.argv) > 4 else None
    model_dir = gb.write_model_dir("/tmp/llama8b", 32)
    t0 = time.perf_counter()
    kv = {"kv_cache_dtype": "fp8"} if quant == "fp8_kv" else {"quantization": quant}
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", max_num_seqs=seqs,
              max_num_batched_tokens=tokens, gpu_memory_utilization=0.9, **kv)  # fmt: skip
    res: dict[str, Any] = {"max_num_seqs": seqs, "max_num_batched_tokens": tokens,
                           "quantization": quant, "init_s": time.perf_counter() - t0,
                           "num_kv_blocks": llm.llm_engine.kv_manager.num_blocks}  # fmt: skip
    sched = llm.llm_engine.scheduler
    inner = sched.schedule
    state: dict[str, Any] = {"decodes": 0, "prof": None, "t": 0.0, "batch": [], "full": 0}

    def schedule(*a, **k):  # noqa: ANN002, ANN003, ANN202
        so = inner(*a, **k)
        tok, reqs = so.total_num_scheduled_tokens, len(so.num_scheduled_tokens)
        if tok == tokens:  # a full prefill step: profile the 3rd and 4th of them
            state["full"] += 1
            if state["full"] == 3:
                state["pprof"] = profile(activities=[ProfilerActivity.CUDA])
                state["pprof"].start()
                state["pt"] = time.perf_counter()
            elif state["full"] == 5:
                torch.cuda.synchronize()
                state["pwall"] = time.perf_counter() - state["pt"]
                state["pprof"].stop()
        if reqs and tok == reqs:
            state["decodes"] += 1
            d = state["decodes"]
            if d == FIRST_PROFILED_DECODE:
                state["prof"] = profile(activities=[ProfilerActivity.CUDA])
                state["prof"].start()
                state["t"] = time.perf_counter()
            elif FIRST_PROFILED_DECODE < d <= FIRST_PROFILED_DECODE + PROFILED_STEPS:
                state["batch"].append(reqs)
                if d == FIRST_PROFILED_DECODE + PROFILED_STEPS:
                    torch.cuda.synchronize()
                    state["wall"] = time.perf_counter() - state["t"]
                    state["prof"].stop()
        return so

    sched.schedule = schedule
    r = gb._offline(llm, n, 256, 256, 1, gb.LLAMA_8B["vocab_size"])
    res["offline_256_256"] = r
    prof = state["prof"]
    if prof is not None and "wall" in state:
        rows = gb.kernel_rows(prof, PROFILED_STEPS, 100)
        res["profile"] = {
            "steps": PROFILED_STEPS,
            "batch": state["batch"],
            "wall_ms_per_step": 1e3 * state["wall"] / PROFILED_STEPS,
            "gpu_ms_per_step": sum(x[0] for x in rows) / 1e3,
            "kernels": [
                {"us": round(u, 1), "calls": round(c, 2), "name": k} for u, c, k in rows[:40]
            ],  # fmt: skip
        }
    pprof = state.get("pprof")
    if pprof is not None and "pwall" in state:
        rows = gb.kernel_rows(pprof, 2, 100)
        res["prefill_profile"] = {
            "steps": 2,
            "tokens_per_step": tokens,
            "wall_ms_per_step": 1e3 * state["pwall"] / 2,
            "gpu_ms_per_step": sum(x[0] for x in rows) / 1e3,
            "kernels": [
                {"us": round(u, 1), "calls": round(c, 2), "name": k} for u, c, k in rows[:30]
            ],  # fmt: skip
        }
    path = os.path.join(out_dir, f"decode_profile_{seqs}{'_' + quant if quant else ''}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    p = res.get("profile", {})
    print(seqs, tokens, "tok/s", r["output_tokens_per_s"], "wall/step", p.get("wall_ms_per_step"),
          "gpu/step", p.get("gpu_ms_per_step"), flush=True)  # fmt: skip
    for k in p.get("kernels", [])[:15]:
        print("  ", k, flush=True)
    pp = res.get("prefill_profile", {})
    print("prefill wall/step", pp.get("wall_ms_per_step"), "gpu/step", pp.get("gpu_ms_per_step"))
    for k in pp.get("kernels", [])[:15]:
        print("  ", k, flush=True)


if __name__ == "__main__":
    main()
