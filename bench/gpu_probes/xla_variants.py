"""Run `bench/step_profile.py` on backend "xla" once per XLA flag variant (each in a fresh
process, since XLA reads its flags when the backend starts) and print one summary line per
variant and batch: wall ms, device busy ms, kernel launches, the largest host parts.

    python -m xlaserve.bench.gpu_probes.xla_variants --out-dir DIR \\
        --variant base= --variant cb=XLASERVE_XLA_COMMAND_BUFFER=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL \\
        -- --batches 1,256 --steps 24

A variant is NAME=ENV1=VAL1;ENV2=VAL2 (empty: the defaults); arguments after `--` go to
step_profile unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--variant", action="append", default=[])
    p.add_argument("--backends", default="xla")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    rest = [x for x in a.rest if x != "--"]
    summary = {}
    for v in a.variant or ["base="]:
        name, _, envs = v.partition("=")
        env = dict(os.environ)
        for kv in filter(None, envs.split(";")):
            k, _, val = kv.partition("=")
            env[k] = val
        out = os.path.join(a.out_dir, f"sp_{name}.json")
        cmd = [sys.executable, "-m", "xlaserve.bench.step_profile", "--backends", a.backends,
               "--output-json", out, *rest]  # fmt: skip
        subprocess.run(cmd, env=env, check=False)
        try:
            with open(out) as f:
                res = json.load(f)
        except (OSError, ValueError) as e:
            summary[name] = {"error": repr(e)}
            continue
        for be in a.backends.split(","):
            r = res.get(be, {})
            for key, val in r.items():
                if not isinstance(val, dict) or "wall_ms_median" not in val:
                    continue
                host = sorted(val.get("host_ms", {}).items(), key=lambda kv: -kv[1])[:6]
                line = {
                    "init_s": round(r.get("init_s", 0), 1),
                    "plain_ms": val.get("wall_ms_plain"),
                    "wall_ms": val.get("wall_ms_median"),
                    "busy_ms": val.get("device_busy_ms"),
                    "launches": val.get("kernel_launches_per_step"),
                    "host": {k: round(x, 2) for k, x in host},
                }
                summary[f"{name}/{be}/{key}"] = line
                print(name, be, key, json.dumps(line), flush=True)
    with open(os.path.join(a.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
