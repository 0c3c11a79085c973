"""Small-M dense matmul for decode steps on GPUs: a Pallas kernel lowered through Triton.

y [M, N] = x [M, K] @ w [N, K]^T for the projections of a decode step (M = the token bucket,
16 at batch 1, so the weight is read once for at most 16 rows and the step is bound by HBM
bandwidth). XLA's own Triton GEMM fusions reach ~61-79% of the bandwidth on these shapes on an
H200 (bench/RESULTS.md, issue 33); this kernel is tuned for the one thing that matters here:
keeping enough weight loads in flight.

Grid (N / BN, SPLIT_K): program (i, s) owns output columns [i BN, (i + 1) BN) and the s-th of
SPLIT_K equal slices of K; it walks its slice in BK steps (a loop Triton software-pipelines over
`num_stages` stages), each step one [M, BK] x [BK, BN] tensor-core dot accumulated in float32.
SPLIT_K > 1 writes float32 partials [SPLIT_K, M, N] that the wrapper sums (deterministic, no
atomics); SPLIT_K = 1 writes y in x's dtype directly.

Triton rules: BN, BK powers of two >= 16; M is padded to a multiple of 16 (tensor-core dots need
M >= 16). Shapes the tiles do not divide are refused by `gemv_supported` (the caller then uses
XLA's dot). On CPU the kernel runs under Pallas' interpreter (tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from xlaserve.kernels_pallas import compat

# The largest token bucket (M) a projection takes the GEMV at: the smallest decode bucket
# (KernelConfig.xla_min_token_bucket's default, batch 1..16). Above it the matmul is a GEMM and
# XLA's own is right there.
MAX_M = 16


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Tile shape and Triton launch parameters (all data, re-tuned from GPU measurements)."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


# (N, K) -> config, from `python -m xlaserve.bench.gpu_probes.pallas_gemv` on the H200 (M = 16,
# bf16; bench/RESULTS.md). Measured: the 8B qkv (torch's fused layout) and o projections, where
# split-K did not win. NOT measured yet (picked from those two; bench/gpu_probes/decode_gemv_ab.py
# sweeps them): the Flax model's separate q (= o's shape), k / v, gate / up, down and lm_head.
# The rule used: 32-column tiles, BK 256, 4 warps; split-K only where N / 32 gives too few
# programs to fill the GPU's 132 SMs (k / v: 32 programs -> split 4 = 128, o's measured count).
TUNED: dict[tuple[int, int], GemvConfig] = {
    (6144, 4096): GemvConfig(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=3),
    (4096, 4096): GemvConfig(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=5),
    # Capped sweep on the H200 (bench/RESULTS.md, 2026-12-04 ninth session, M = 16, <= 6
    # configs a shape): k / v 13.4 us vs XLA 18.8, gate / up 39.6 vs 46.7; down and lm_head
    # found nothing faster than XLA (40.6 vs 39.7 us, 259.7 vs 255.1 us: picks kept).
    (1024, 4096): GemvConfig(block_n=16, block_k=256, split_k=4, num_warps=4, num_stages=3),
    (14336, 4096): GemvConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
    (4096, 14336): GemvConfig(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=5),
    (128256, 4096): GemvConfig(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=3),
}


def _pow2_tile(dim: int, largest: int) -> int:
    """The largest power of two in [16, largest] dividing `dim` (0: none, the GEMV cannot tile it)."""
    t = largest
    while t >= 16:
        if dim % t == 0:
            return t
        t //= 2
    return 0


def default_config(n: int, k: int) -> GemvConfig:
    """The tuned config of (n, k), else narrow column tiles (many programs), the widest K tile
    <= 256 that divides k, no split-K (a tile of 0 means the shape is not covered)."""
    if (n, k) in TUNED:
        return TUNED[(n, k)]
    return GemvConfig(block_n=_pow2_tile(n, 64), block_k=_pow2_tile(k, 256), split_k=1)


def gemv_supported(m: int, n: int, k: int, cfg: GemvConfig) -> bool:
    """The tiles divide the shape (no masks in the kernel) and M is a decode bucket."""
    if not all(v >= 16 and v & (v - 1) == 0 for v in (cfg.block_n, cfg.block_k)):
        return False
    per_split = k // cfg.split_k
    return (
        m <= MAX_M
        and n % cfg.block_n == 0
        and k % cfg.split_k == 0
        and per_split % cfg.block_k == 0
    )


def _gemv_kernel(x_ref, w_ref, o_ref, *, block_n: int, block_k: int, steps: int, m: int):  # noqa: ANN001, ANN202
    i, s = pl.program_id(0), pl.program_id(1)
    n0 = i * block_n
    k0 = s * steps * block_k

    def body(j, acc):  # noqa: ANN001, ANN202
        kk = pl.multiple_of(k0 + j * block_k, block_k)
        xk = x_ref[:, pl.ds(kk, block_k)]  # [M, BK]
        wk = w_ref[pl.ds(n0, block_n), pl.ds(kk, block_k)]  # [BN, BK]
        dims = (((1,), (1,)), ((), ()))  # x @ w^T: contract both minor dims
        return acc + lax.dot_general(xk, wk, dims, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((m, block_n), jnp.float32))
    o_ref[s, :, pl.ds(n0, block_n)] = acc.astype(o_ref.dtype)


def gemv(
    x: jax.Array, w: jax.Array, cfg: GemvConfig | None = None, interpret: bool | None = None
) -> jax.Array:
    """x [M, K] (M <= MAX_M), w [N, K] -> x @ w^T [M, N] in x's dtype, float32 accumulation.
    cfg None: `default_config`. Raises ValueError where `gemv_supported` is False."""
    m, k = x.shape
    n, k2 = w.shape
    if k != k2:
        raise ValueError(f"gemv: x [{m}, {k}] and w [{n}, {k2}] disagree on K")
    cfg = cfg or default_config(n, k)
    if not gemv_supported(m, n, k, cfg):
        raise ValueError(f"gemv: M={m}, N={n}, K={k} not covered by {cfg}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    mp = max(16, -(-m // 16) * 16)
    xp = x if mp == m else jnp.pad(x, ((0, mp - m), (0, 0)))
    split = cfg.split_k
    steps = k // split // cfg.block_k
    out_dtype = x.dtype if split == 1 else jnp.float32
    kernel = functools.partial(
        _gemv_kernel, block_n=cfg.block_n, block_k=cfg.block_k, steps=steps, m=mp
    )
    out = pl.pallas_call(
        kernel,
        grid=(n // cfg.block_n, split),
        out_shape=jax.ShapeDtypeStruct((split, mp, n), out_dtype),
        compiler_params=compat.gpu_compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=f"xlaserve_gemv_n{cfg.block_n}_k{cfg.block_k}_s{split}",
    )(xp, w)  # fmt: skip
    y = out[0] if split == 1 else jnp.sum(out, axis=0).astype(x.dtype)
    return y[:m]


def gemv_ref(x: jax.Array, w: jax.Array) -> jax.Array:
    """The plain reference: float32 accumulation, x's dtype out."""
    y = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


# ---- the decode-GEMV policy of the Flax linears (KernelConfig.xla_decode_gemv) -----------------

# What "auto" means on a GPU: True = the GEMV for the shapes TUNED has (the rest keep XLA's dot),
# False = XLA's dot everywhere. False until the step-level A/B on the H200
# (bench/gpu_probes/decode_gemv_ab.py) shows the GEMV faster: flipping "auto" is this one line.
AUTO_ON_GPU = False

# Float dtypes the GEMV serves (quantized linears are QuantLinear, never here). float32 only
# under the interpreter (CPU tests of the wiring; the demo model is float32): Triton's float32
# dot would use TF32 on the GPU, which XLA's float32 dot does not.
_GEMV_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def resolve_decode_gemv(mode: str, platform: str, tp_size: int = 1) -> str:
    """KernelConfig.xla_decode_gemv -> the policy the Linear layers carry (static):
    "off" = XLA's dot; "tuned" = the GEMV for shapes in TUNED; "all" = every shape it tiles.

    mode "on" -> "all" on GPU (Triton lowering) and CPU (Pallas' interpreter: tests);
    "auto" -> "tuned" on GPU when AUTO_ON_GPU, else "off". Always "off" on TPU (the kernel has
    a Triton lowering only; Mosaic is not verified for it) and under tensor parallelism
    (`tp_size` > 1: a pallas_call is not partitioned by GSPMD, as for QuantLinear's kernels).
    `platform` is `jax.default_backend()` ("gpu", "cpu", "tpu")."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"xla_decode_gemv must be 'auto', 'on' or 'off', got {mode!r}")
    if mode == "off" or tp_size > 1 or platform not in ("gpu", "cpu"):
        return "off"
    if mode == "on":
        return "all"
    return "tuned" if platform == "gpu" and AUTO_ON_GPU else "off"


def decode_gemv_config(
    policy: str, m: int, n: int, k: int, x_dtype: jnp.dtype, w_dtype: jnp.dtype
) -> GemvConfig | None:
    """The config a Linear of weight [n, k] runs x [m, k] with under `policy`
    (`resolve_decode_gemv`), or None for XLA's dot: policy "off", M above MAX_M (prefill and
    larger decode buckets), a dtype other than bf16 / f16 (float32 too under the interpreter),
    x and w of different dtypes, a shape outside TUNED under "tuned", or tiles that do not fit."""
    if policy == "off" or m > MAX_M or jnp.dtype(x_dtype) != jnp.dtype(w_dtype):
        return None
    interpreted = jax.default_backend() != "gpu"
    if jnp.dtype(x_dtype) not in _GEMV_DTYPES and not (
        interpreted and jnp.dtype(x_dtype) == jnp.dtype(jnp.float32)
    ):
        return None
    if policy == "tuned" and (n, k) not in TUNED:
        return None
    cfg = default_config(n, k)
    return cfg if gemv_supported(m, n, k, cfg) else None
