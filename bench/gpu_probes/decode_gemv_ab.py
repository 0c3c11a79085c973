"""Issue 33, batch-1 decode: is the Pallas decode GEMV (kernels_pallas/gemv.py) worth turning on
for the XLA backend's Flax linears (KernelConfig.xla_decode_gemv)? One command, three parts, each
in its own subprocess (a JAX process preallocates most of the GPU memory, so the parts do not
share one):

1. a CAPPED config sweep (bench/gpu_probes/pallas_gemv.py --capped, <= 6 configs a shape) of the
   Flax model's shapes whose TUNED entries were picked, not measured: gate / up (14336 x 4096),
   down (4096 x 14336), k / v (1024 x 4096), lm_head (128256 x 4096); XLA's dot alongside;
2. the XLA backend's batch-1 decode step (bench/step_profile.py: Llama-3.1-8B shape, dummy bf16
   weights, 128-token prompt) with XLASERVE_XLA_DECODE_GEMV=off, then =on: plain ms per step
   (nothing traced), device busy ms, the forward program's device ms, and the GEMV kernels' ms;
3. a summary (printed and in DIR/summary.json): per shape XLA us / TUNED us / best us and the
   best config (to paste into TUNED), and the step A/B with its speed-up.

    python -m xlaserve.bench.gpu_probes.decode_gemv_ab --out-dir gemv_ab

Expected on an H200: ~2.5 min (sweep ~40 s, each step run ~50 s: start-up compiles four token
buckets); the part timeouts (--timeouts, default 75,85,85 s) cap it at ~4 min (a sweep cut short
keeps the shapes it finished). CPU smoke test
(tiny shapes, float32, the GEMV under Pallas' interpreter):
`python -m xlaserve.bench.gpu_probes.decode_gemv_ab --out-dir /tmp/ab --tiny --shapes tiny`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from xlaserve.bench.gpu_bench import write_model_dir


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    t = time.perf_counter()
    print("==", " ".join(cmd[2:]), flush=True)
    try:
        rc: int | str = subprocess.run(cmd, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    return {"returncode": rc, "wall_s": round(time.perf_counter() - t, 1)}


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _step_row(res: dict[str, Any] | None) -> dict[str, Any] | None:
    """The batch-1 figures of one step_profile run (None when it did not finish)."""
    row = ((res or {}).get("xla") or {}).get("batch1")
    if not row:
        return None
    kernels = row.get("kernel_ms", {})
    fwd = {k: v for k, v in row.get("device_ms", {}).items() if "forward" in k}
    return {
        "init_s": round(res["xla"].get("init_s", 0.0), 1),
        "plain_ms": round(row["wall_ms_plain"], 3),
        "traced_ms": round(row["wall_ms_median"], 3),
        "busy_ms": row.get("device_busy_ms") and round(row["device_busy_ms"], 3),
        "forward_device_ms": {k: round(v, 3) for k, v in fwd.items()},
        "launches": row.get("kernel_launches_per_step"),
        # the top-25 kernel list of the trace: GEMV kernels are named xlaserve_gemv_*
        "gemv_kernels_ms": round(sum(v for k, v in kernels.items() if "xlaserve_gemv" in k), 3),
        "top_kernels_ms": {k: round(v, 3) for k, v in list(kernels.items())[:8]},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--shapes", default="gate,down,kv,lm_head", help="sweep shapes ('' = none)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--modes", default="off,on", help="xla_decode_gemv values of the step A/B")
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="tiny model shape (CPU smoke test)")
    p.add_argument("--timeouts", default="75,85,85", help="sweep, then each step run, seconds")
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    limits = [float(t) for t in a.timeouts.split(",")]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    py = [sys.executable, "-m"]
    summary: dict[str, Any] = {"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M")}
    t0 = time.perf_counter()

    if a.shapes:
        out = os.path.join(a.out_dir, "sweep.json")
        cmd = py + ["xlaserve.bench.gpu_probes.pallas_gemv", "--capped", "--shapes", a.shapes]
        cmd += ["--iters", str(a.iters), "--out", out]
        summary["sweep_run"] = _run(cmd, env, limits[0])
        sweep = _load(out) or {}
        summary["sweep"] = {
            name: {
                "n_k": [r["n"], r["k"]],
                "xla_us": round(r["xla_us"], 2),
                "tuned_us": r["tuned"] and round(r["tuned"]["us"], 2),
                "best_us": r["best"] and round(r["best"]["us"], 2),
                "best_cfg (BN, BK, split, warps, stages)": r["best"] and r["best"]["cfg"],
                "best_vs_xla": r["best"] and round(r["xla_us"] / r["best"]["us"], 3),
            }
            for name, r in sweep.items()
        }

    model_dir = write_model_dir(os.path.join(a.out_dir, "model"), a.num_layers, a.tiny)
    steps: dict[str, Any] = {}
    for mode in filter(None, a.modes.split(",")):
        out = os.path.join(a.out_dir, f"step_{mode}.json")
        if os.path.exists(out):
            os.remove(out)
        cmd = py + ["xlaserve.bench.step_profile", "--backends", "xla", "--batches", "1"]
        cmd += ["--model", model_dir, "--steps", str(a.steps), "--warmup", str(a.warmup)]
        cmd += ["--max-num-batched-tokens", "128", "--max-model-len", "512"]
        limit = limits[1] if len(limits) > 1 else limits[0]
        cmd += ["--timeout", str(int(limit) - 5), "--output-json", out]
        cmd += ["--tiny"] if a.tiny else []
        run = _run(cmd, dict(env, XLASERVE_XLA_DECODE_GEMV=mode), limit)
        steps[mode] = {"run": run, "batch1": _step_row(_load(out))}
    summary["step_batch1"] = steps
    off, on = (steps.get(m, {}).get("batch1") for m in ("off", "on"))
    if off and on:
        summary["step_speedup_on_vs_off"] = round(off["plain_ms"] / on["plain_ms"], 3)
    summary["total_s"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(a.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "argv"}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
