"""Sweep the Pallas decode GEMV (kernels_pallas/gemv.py) against XLA's own dot at the
Llama-3.1-8B projection shapes (M = 16, bf16): checks each config against the reference, times
it with weights rotated over several copies (so L2 does not serve them), and prints one JSON line
per shape with XLA's time, the best config and its time.

    python -m xlaserve.bench.gpu_probes.pallas_gemv --out gemv.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

SHAPES = {
    "tiny": (64, 512),
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


def _time(fn, x, ws, iters: int) -> float:  # noqa: ANN001
    """Seconds per matmul: one program runs `fn` once per weight copy (rotating copies, so L2
    does not serve the weights; one dispatch, so host time does not count), `iters` times."""
    import jax

    many = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    jax.block_until_ready(many(x, ws))
    t = time.perf_counter()
    for _ in range(iters):
        out = many(x, ws)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters / len(ws)


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from xlaserve.kernels_pallas.gemv import GemvConfig, gemv, gemv_ref, gemv_supported

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gemv.json")
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    rng = np.random.default_rng(0)
    results = {}
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(4, int(600e6 // (n * k * 2)))  # > L2 in total
        ws = [jnp.asarray(rng.standard_normal((n, k), np.float32), jnp.bfloat16) for _ in range(copies)]  # fmt: skip
        x = jnp.asarray(rng.standard_normal((a.m, k), np.float32), jnp.bfloat16)
        ref = np.asarray(gemv_ref(x, ws[0]), np.float32)
        scale = float(np.abs(ref).max())

        def xla(x, w):  # noqa: ANN001, ANN202
            return jnp.einsum("ti,oi->to", x, w)

        t_xla = _time(xla, x, ws, a.iters)
        nbytes = n * k * 2
        rows = []
        grid = itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), (4, 8), (3, 5))
        for bn, bk, split, warps, stages in grid:
            cfg = GemvConfig(bn, bk, split, warps, stages)
            if not gemv_supported(a.m, n, k, cfg):
                continue
            try:
                fn = functools.partial(gemv, cfg=cfg)
                got = np.asarray(jax.jit(fn)(x, ws[0]), np.float32)
                err = float(np.abs(got - ref).max()) / scale
                t = _time(fn, x, ws, a.iters)
            except Exception as e:  # noqa: BLE001 - a config Triton refuses is a row, not a stop
                rows.append({"cfg": list(dataclass_tuple(cfg)), "error": repr(e)[:200]})
                continue
            rows.append({"cfg": list(dataclass_tuple(cfg)), "us": t * 1e6, "rel_err": err,
                         "gbs": nbytes / t / 1e9})  # fmt: skip
        ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        results[name] = {"n": n, "k": k, "xla_us": t_xla * 1e6, "xla_gbs": nbytes / t_xla / 1e9,
                         "best": best, "rows": rows}  # fmt: skip
        line = {"shape": name, "xla_us": round(t_xla * 1e6, 1), "best": best and
                {k: (round(v, 4) if isinstance(v, float) else v) for k, v in best.items()},
                "errors": sum("error" in r for r in rows), "configs": len(rows)}  # fmt: skip
        print(json.dumps(line), flush=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)


def dataclass_tuple(cfg) -> tuple:  # noqa: ANN001
    import dataclasses

    return dataclasses.astuple(cfg)


if __name__ == "__main__":
    main()
