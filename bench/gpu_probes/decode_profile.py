#!/usr/bin/env python
"""GPU probe: where a decode step of the offline benchmark spends its GPU time, at real context
lengths (the graph-replay profile in gpu_bench replays with whatever the last step left behind).

    OUT=dir python bench/gpu_probes/decode_profile.py MAX_NUM_SEQS MAX_NUM_BATCHED_TOKENS [N] [Q]
    python bench/gpu_probes/decode_profile.py --compare BASE.json RUN.json [SPEEDUP ...]  # CPU
    # -> $OUT/decode_profile_<MAX_NUM_SEQS>[_<Q>].json; Q: LLM(quantization=Q), e.g. fp8,
    # or fp8_kv: LLM(kv_cache_dtype="fp8") with bf16 weights

Llama-3.1-8B shape, dummy bf16 weights, the gpu_bench engine settings except the two limits.
Runs the offline 256 / 256 benchmark over N prompts (default 1000) and, inside it, profiles
(torch.profiler, CUPTI: kernels inside CUDA graphs included) the 8 pure-decode steps that follow the first
wave's 128th decode step (contexts ~384 tokens), and the 3rd and 4th full prefill steps
(MAX_NUM_BATCHED_TOKENS tokens each). The profiler's start / stop run inside the timed run, so
this run's throughput is not a benchmark figure. Reports GPU time per step by kernel, the GPU
busy time per step against the wall time per step, and the host/device split of gpu_bench.

`--compare` (no GPU): two such JSONs (e.g. bf16 and fp8) by kernel class (attention, GEMM,
separate act quant, other) side by side, and a computed projection of the second run with its
GEMMs at given speedups over the first's (`project`): the bound weight quantization can reach
while attention and the rest stay as measured.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

PROFILED_STEPS = 8
FIRST_PROFILED_DECODE = 128

# Kernel classes by name (lower case; the first class with a matching pattern wins). The
# fused producers of quantized activations (_rms_norm_quant / _silu_mul_quant) count as norm /
# activation work, "other": only the separate `quant_rows` kernel is "act_quant".
KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention", "fmha", "flash", "sdpa", "merge_splits", "merge_lse")),
    ("act_quant", ("_quant_rows_kernel",)),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "scaled_mm", "_int8_mm", "dense_gemv")),
)
SECTIONS = ("profile", "prefill_profile")  # the decode steps, the full prefill steps


def kernel_class(name: str) -> str:
    """ "attention", "act_quant", "gemm" or "other" for a profiled kernel's name."""
    low = name.lower()
    return next((c for c, pats in KERNEL_CLASSES if any(p in low for p in pats)), "other")


def class_ms(section: dict[str, Any]) -> dict[str, float]:
    """GPU ms per step by kernel class of one profiled section (decode or prefill steps), plus
    "gpu" (the total) and "wall"; "other" is the total less the classified kernels (the JSON
    lists the top kernels only)."""
    per = {c: 0.0 for c, _ in KERNEL_CLASSES}
    for k in section["kernels"]:
        c = kernel_class(k["name"])
        if c != "other":
            per[c] += k["us"] / 1e3
    gpu = section["gpu_ms_per_step"]
    return {**per, "other": gpu - sum(per.values()), "gpu": gpu,
            "wall": section["wall_ms_per_step"]}  # fmt: skip


def project(
    base: dict[str, Any], run: dict[str, Any], gemm_speedup: tuple[float, float], keep_quant: bool
) -> dict[str, float]:
    """Computed, not measured: `run`'s profile with its GEMMs at gemm_speedup = (decode,
    prefill) x `base`'s GEMM time and, unless keep_quant, no separate act-quant kernel; each
    step keeps `run`'s own wall - GPU gap. Returns the projected wall ms per decode / prefill
    step and the offline run's ratio to base's: base's run time split into decode and full
    prefill steps (steps_last_run, the prefill count from the prompts' tokens), each part
    scaled by its step's ratio."""
    out: dict[str, float] = {}
    for sec, g in zip(SECTIONS, gemm_speedup, strict=True):
        b, r = class_ms(base[sec]), class_ms(run[sec])
        gpu = r["attention"] + r["other"] + b["gemm"] / g + (r["act_quant"] if keep_quant else 0)
        out[sec] = gpu + (r["wall"] - r["gpu"])
    off = base["offline_256_256"]
    n_fill = off["num_prompts"] * off["input_len"] / base["max_num_batched_tokens"]
    t_fill = n_fill * base["prefill_profile"]["wall_ms_per_step"]
    t_dec = (off["steps_last_run"] - n_fill) * base["profile"]["wall_ms_per_step"]
    t_new = (
        t_dec * out["profile"] / class_ms(base["profile"])["wall"]
        + t_fill * out["prefill_profile"] / class_ms(base["prefill_profile"])["wall"]
    )
    return {"decode_ms": out["profile"], "prefill_ms": out["prefill_profile"],
            "offline_ratio": (t_dec + t_fill) / t_new}  # fmt: skip


def compare(base_path: str, run_path: str, speedups: list[float]) -> dict[str, Any]:
    """`--compare`: both profiles by kernel class, side by side, and `project` at each GEMM
    speedup (the same at decode and prefill) and at the run's own measured GEMM ratios."""
    with open(base_path) as f:
        base = json.load(f)
    with open(run_path) as f:
        run = json.load(f)
    res: dict[str, Any] = {}
    for sec in SECTIONS:
        res[sec] = {"base": class_ms(base[sec]), "run": class_ms(run[sec])}
    measured = tuple(res[s]["base"]["gemm"] / res[s]["run"]["gemm"] for s in SECTIONS)
    res["measured_gemm_ratio"] = measured
    res["measured_offline_ratio"] = (
        run["offline_256_256"]["output_tokens_per_s"]
        / base["offline_256_256"]["output_tokens_per_s"]
    )
    res["projected_measured_gemms"] = project(base, run, measured, keep_quant=True)
    res["projected"] = {str(g): project(base, run, (g, g), keep_quant=False) for g in speedups}
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--compare":
        speedups = [float(v) for v in sys.argv[4:]] or [1.5, 1.75, 2.0]
        res = compare(sys.argv[2], sys.argv[3], speedups)
        for sec in SECTIONS:
            for side in ("base", "run"):
                row = ", ".join(f"{k} {v:.2f}" for k, v in res[sec][side].items())
                print(f"{sec} {side}: {row} ms/step")
        print("measured GEMM ratio (decode, prefill):", res["measured_gemm_ratio"],
              "offline ratio:", round(res["measured_offline_ratio"], 3))  # fmt: skip
        print("projected with the measured GEMMs:", res["projected_measured_gemms"])
        for g, p in res["projected"].items():
            print(f"projected, GEMMs {g}x base, no act quant (computed): {p}")
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    from xlaserve import LLM
    from xlaserve.bench import gpu_bench as gb

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
