#!/usr/bin/env python
"""GPU probe: where the offline run of a state-space model spends its time.

    OUT=dir python -m xlaserve.bench.gpu_probes.ssm_profile SHAPE [N] [MAX_NUM_SEQS]
    # SHAPE: mamba2 | bamba (bench/ssm_bench.py's dummy shapes) -> $OUT/ssm_profile_<SHAPE>.json

Runs the offline 256 / 256 benchmark over N prompts (default 256) with the ssm_bench engine
settings, counts the prefill / mixed and pure-decode steps with the wall time of each kind
(the schedule hook synchronizes the device at every step, so this run's throughput is not a
benchmark figure), and profiles (torch.profiler, CUPTI: kernels inside CUDA graphs included) 8
pure-decode steps after the first wave's 64th decode step and the 2nd and 3rd steps that
schedule prefill work. Also one batch-1 decode graph replay's kernels.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from xlaserve.bench import gpu_bench as gb
from xlaserve.bench import ssm_bench as sb

PROFILED_STEPS = 8
FIRST_PROFILED_DECODE = 64


def _rows(prof: Any, reps: int, top: int) -> list[dict[str, Any]]:
    return [
        {"us": round(u, 1), "calls": round(c, 2), "name": k}
        for u, c, k in gb.kernel_rows(prof, reps, 100)[:top]
    ]


def main() -> None:
    from xlaserve import LLM, SamplingParams

    out_dir = os.environ.get("OUT", "/tmp")
    shape = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    kw: dict[str, Any] = {}
    if len(sys.argv) > 3:
        kw["max_num_seqs"] = int(sys.argv[3])
    path = sb.write_model(shape, tempfile.mkdtemp(), tiny=False)
    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=1024, **kw)
    res: dict[str, Any] = {"shape": shape, "prompts": n, "init_s": time.perf_counter() - t0}
    sched = llm.llm_engine.scheduler
    res["max_num_seqs"] = sched.config.max_num_seqs if hasattr(sched, "config") else None
    inner = sched.schedule
    st: dict[str, Any] = {"decodes": 0, "prefills": 0, "last": None, "kind": None,
                          "wall": {"decode": 0.0, "prefill": 0.0}, "batch": []}  # fmt: skip

    def schedule(*a, **k):  # noqa: ANN002, ANN003, ANN202
        torch.cuda.synchronize()
        now = time.perf_counter()
        if st["last"] is not None:
            st["wall"][st["kind"]] += now - st["last"]
        so = inner(*a, **k)
        tok, reqs = so.total_num_scheduled_tokens, len(so.num_scheduled_tokens)
        st["last"], st["kind"] = now, "decode" if reqs and tok == reqs else "prefill"
        if st["kind"] == "prefill" and reqs:
            st["prefills"] += 1
            if st["prefills"] == 2:
                st["pprof"] = profile(activities=[ProfilerActivity.CUDA])
                st["pprof"].start()
                st["pt"] = now
                st["ptokens"] = [tok]
            elif st["prefills"] == 3:
                st["ptokens"].append(tok)
            elif st["prefills"] == 4:
                st["pwall"] = now - st["pt"]
                st["pprof"].stop()
        elif reqs:
            st["decodes"] += 1
            d = st["decodes"]
            if d == FIRST_PROFILED_DECODE:
                st["prof"] = profile(activities=[ProfilerActivity.CUDA])
                st["prof"].start()
                st["t"] = now
            elif FIRST_PROFILED_DECODE < d <= FIRST_PROFILED_DECODE + PROFILED_STEPS:
                st["batch"].append(reqs)
                if d == FIRST_PROFILED_DECODE + PROFILED_STEPS:
                    st["dwall"] = time.perf_counter() - st["t"]
                    st["prof"].stop()
        return so

    vocab = llm.llm_engine.core.spec.vocab_size
    prompts = [{"prompt_token_ids": p} for p in sb._prompts(n, 256, vocab)]
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    sched.schedule = schedule
    t1 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    res["offline_wall_s"] = time.perf_counter() - t1
    res["steps"] = {"prefill": st["prefills"], "decode": st["decodes"], "wall_s": st["wall"]}
    if "dwall" in st:
        rows = gb.kernel_rows(st["prof"], PROFILED_STEPS, 100)
        res["decode_profile"] = {
            "batch": st["batch"], "wall_ms_per_step": 1e3 * st["dwall"] / PROFILED_STEPS,
            "gpu_ms_per_step": sum(x[0] for x in rows) / 1e3,
            "kernels": _rows(st["prof"], PROFILED_STEPS, 25),
        }  # fmt: skip
    if "pwall" in st:
        rows = gb.kernel_rows(st["pprof"], 2, 100)
        res["prefill_profile"] = {
            "tokens": st["ptokens"], "wall_ms_per_step": 1e3 * st["pwall"] / 2,
            "gpu_ms_per_step": sum(x[0] for x in rows) / 1e3,
            "kernels": _rows(st["pprof"], 2, 25),
        }  # fmt: skip
    step = getattr(llm.llm_engine.core.runner, "cuda_step", None)
    if step is not None and 1 in step.graphs:
        g = step.graphs[1][0]
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
        rows = gb.kernel_rows(prof, 5, 100)
        res["batch1_graph"] = {
            "gpu_ms": sum(x[0] for x in rows) / 1e3,
            "launches": round(sum(x[1] for x in rows)),
            "kernels": _rows(prof, 5, 15),
        }  # fmt: skip
    with open(os.path.join(out_dir, f"ssm_profile_{shape}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in res.items() if "profile" not in k and k != "batch1_graph"}))
    for key in ("decode_profile", "prefill_profile", "batch1_graph"):
        p = res.get(key, {})
        print(key, {k: v for k, v in p.items() if k != "kernels"}, flush=True)
        for row in p.get("kernels", [])[:12]:
            print("  ", row, flush=True)


if __name__ == "__main__":
    main()
