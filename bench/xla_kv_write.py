"""Is the XLA backend's KV-cache write in place? Times `write_kv` on a donated cache of N blocks
[N, 16, 8, 128] for two N per dtype: in place, the time does not grow with N.

    python -m xlaserve.bench.xla_kv_write [--blocks 1024,65536]

(On XLA:CPU a bfloat16 or fp8 cache is copied whole by every scatter: XLA's float normalization
upcasts the operand; the XLA runner keeps a float32 cache on the CPU for that reason.)
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from xlaserve.kernels_pallas import write_kv


def time_write(n: int, dtype: jnp.dtype, iters: int = 20) -> float:
    """Milliseconds per jitted write of 8 tokens into a donated (k, v) cache of n blocks."""
    kv = (jnp.zeros((n, 16, 8, 128), dtype), jnp.zeros((n, 16, 8, 128), dtype))
    step = jax.jit(lambda kv, x, s: write_kv(kv[0], kv[1], x, x, s), donate_argnums=(0,))
    x = jnp.ones((8, 8, 128), jnp.float32)
    slots = jnp.arange(8, dtype=jnp.int32)
    for _ in range(3):
        kv = step(kv, x, slots)
    jax.block_until_ready(kv)
    t = time.perf_counter()
    for _ in range(iters):
        kv = step(kv, x, slots)
    jax.block_until_ready(kv)
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="1024,65536")
    ap.add_argument("--dtypes", default="bfloat16,float8_e4m3fn,float32")
    args = ap.parse_args()
    rows = []
    for name in args.dtypes.split(","):
        for n in map(int, args.blocks.split(",")):
            rows.append({"dtype": name, "blocks": n, "ms": time_write(n, jnp.dtype(name))})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"device": str(jax.devices()[0]), "rows": rows}))


if __name__ == "__main__":
    main()
