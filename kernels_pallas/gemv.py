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
# False = XLA's dot everywhere. True since the step-level A/B on the H200 with q/k/v merged and
# gate/up gated (bench/gpu_probes/decode_gemv_ab.py, Llama-3.1-8B, batch-1 step: 4.93 ms with
# XLA's dots, 4.53 ms with every TUNED shape through the GEMV = 1.09x; bench/RESULTS.md).
AUTO_ON_GPU = True

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


# ---- multi-weight GEMVs: sibling projections that share x in ONE launch (issue 33) -------------

# Merged shapes (sum of N, K) -> config. NOT measured: picked from the single-weight table (the
# qkv merge 4096 + 2 x 1024 = 6144 columns at K 4096 is torch's fused qkv shape, measured at
# BN 32 / BK 256 / 3 stages; gate + up: 14336's measured pick, both accumulators in one program).
# bench/gpu_probes/pallas_gemv.py should sweep them (<= 6 configs each) before "auto" uses them.
TUNED_MULTI: dict[tuple[int, int], GemvConfig] = {
    (6144, 4096): GemvConfig(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=3),
}
TUNED_GATED: dict[tuple[int, int], GemvConfig] = {
    (14336, 4096): GemvConfig(block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
}


def _gemv_multi_kernel(*refs, block_n: int, block_k: int, steps: int, m: int, starts: tuple):  # noqa: ANN002, ANN202
    """Program (b, s): global column block b of the concatenated N range; the weight it falls in
    is chosen by `pl.when` on static block offsets (one branch per weight, each its own refs)."""
    nw = len(starts) - 1
    x_ref, w_refs, o_refs = refs[0], refs[1 : 1 + nw], refs[1 + nw :]
    b, s = pl.program_id(0), pl.program_id(1)
    k0 = s * steps * block_k
    for j in range(nw):

        @pl.when((b >= starts[j]) & (b < starts[j + 1]))
        def _(j=j):  # noqa: ANN202
            n0 = (b - starts[j]) * block_n

            def body(t, acc):  # noqa: ANN001, ANN202
                kk = pl.multiple_of(k0 + t * block_k, block_k)
                xk = x_ref[:, pl.ds(kk, block_k)]
                wk = w_refs[j][pl.ds(n0, block_n), pl.ds(kk, block_k)]
                dims = (((1,), (1,)), ((), ()))
                return acc + lax.dot_general(xk, wk, dims, preferred_element_type=jnp.float32)

            acc = lax.fori_loop(0, steps, body, jnp.zeros((m, block_n), jnp.float32))
            o_refs[j][s, :, pl.ds(n0, block_n)] = acc.astype(o_refs[j].dtype)


def gemv_multi(
    x: jax.Array,
    ws: tuple[jax.Array, ...],
    cfg: GemvConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, ...]:
    """x [M, K], ws (w_i [N_i, K]) -> (x @ w_i^T [M, N_i], ...) in ONE pallas_call: the grid
    covers sum(N_i) / BN column blocks (x's tiles shared; XLA merges such sibling dots into one
    fusion, separate GEMVs lost to it). Every N_i must be a multiple of BN (no masks).
    cfg None: TUNED_MULTI[(sum N_i, K)], else `default_config` of the smallest N_i."""
    m, k = x.shape
    if not ws:
        raise ValueError("gemv_multi: no weights")
    ns = [w.shape[0] for w in ws]
    for w in ws:
        if w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"gemv_multi: x [{m}, {k}] and w {tuple(w.shape)} disagree on K")
    cfg = cfg or TUNED_MULTI.get((sum(ns), k)) or default_config(min(ns), k)
    if not all(gemv_supported(m, n, k, cfg) for n in ns):
        raise ValueError(f"gemv_multi: M={m}, N={ns}, K={k} not covered by {cfg}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    mp = max(16, -(-m // 16) * 16)
    xp = x if mp == m else jnp.pad(x, ((0, mp - m), (0, 0)))
    split = cfg.split_k
    starts = [0]
    for n in ns:
        starts.append(starts[-1] + n // cfg.block_n)
    out_dtype = x.dtype if split == 1 else jnp.float32
    kernel = functools.partial(
        _gemv_multi_kernel, block_n=cfg.block_n, block_k=cfg.block_k,
        steps=k // split // cfg.block_k, m=mp, starts=tuple(starts),
    )  # fmt: skip
    outs = pl.pallas_call(
        kernel,
        grid=(starts[-1], split),
        out_shape=tuple(jax.ShapeDtypeStruct((split, mp, n), out_dtype) for n in ns),
        compiler_params=compat.gpu_compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=f"xlaserve_gemv_multi{len(ns)}_n{cfg.block_n}_k{cfg.block_k}_s{split}",
    )(xp, *ws)  # fmt: skip
    ys = [o[0] if split == 1 else jnp.sum(o, axis=0).astype(x.dtype) for o in outs]
    return tuple(y[:m] for y in ys)


def _gemv_gated_kernel(
    x_ref, g_ref, u_ref, o_ref, *, block_n: int, block_k: int, steps: int, m: int, act
):  # noqa: ANN001, ANN202, E501
    n0 = pl.program_id(0) * block_n

    def body(t, accs):  # noqa: ANN001, ANN202
        ga, ua = accs
        kk = pl.multiple_of(t * block_k, block_k)
        xk = x_ref[:, pl.ds(kk, block_k)]
        dims = (((1,), (1,)), ((), ()))
        gk = g_ref[pl.ds(n0, block_n), pl.ds(kk, block_k)]
        uk = u_ref[pl.ds(n0, block_n), pl.ds(kk, block_k)]
        ga = ga + lax.dot_general(xk, gk, dims, preferred_element_type=jnp.float32)
        ua = ua + lax.dot_general(xk, uk, dims, preferred_element_type=jnp.float32)
        return ga, ua

    zero = jnp.zeros((m, block_n), jnp.float32)
    ga, ua = lax.fori_loop(0, steps, body, (zero, zero))
    # Epilogue in float32: the activation of the exact gate sum (why split-K is refused here).
    o_ref[:, pl.ds(n0, block_n)] = (act(ga) * ua).astype(o_ref.dtype)


def gemv_gated(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    act,  # noqa: ANN001 - an elementwise jnp function (jax.nn.silu, gelu, ...)
    cfg: GemvConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """x [M, K], w_gate / w_up [N, K] -> act(x @ w_gate^T) * (x @ w_up^T) [M, N] in x's dtype:
    one program computes the same N block of gate and up (x tile read once), the activation and
    product in the epilogue. Split-K is refused (the activation needs the full gate sum).
    cfg None: TUNED_GATED[(N, K)], else `default_config(N, K)` with split_k 1."""
    m, k = x.shape
    if w_gate.shape != w_up.shape or w_gate.ndim != 2 or w_gate.shape[1] != k:
        raise ValueError(
            f"gemv_gated: x [{m}, {k}], w_gate {tuple(w_gate.shape)} and w_up "
            f"{tuple(w_up.shape)} disagree"
        )
    n = w_gate.shape[0]
    cfg = cfg or TUNED_GATED.get((n, k)) or dataclasses.replace(default_config(n, k), split_k=1)
    if cfg.split_k != 1 or not gemv_supported(m, n, k, cfg):
        raise ValueError(f"gemv_gated: M={m}, N={n}, K={k} not covered by {cfg} (split_k 1)")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    mp = max(16, -(-m // 16) * 16)
    xp = x if mp == m else jnp.pad(x, ((0, mp - m), (0, 0)))
    kernel = functools.partial(
        _gemv_gated_kernel, block_n=cfg.block_n, block_k=cfg.block_k,
        steps=k // cfg.block_k, m=mp, act=act,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid=(n // cfg.block_n,),
        out_shape=jax.ShapeDtypeStruct((mp, n), x.dtype),
        compiler_params=compat.gpu_compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=f"xlaserve_gemv_gated_n{cfg.block_n}_k{cfg.block_k}",
    )(xp, w_gate, w_up)  # fmt: skip
    return out[:m]


def gemv_gated_ref(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, act) -> jax.Array:  # noqa: ANN001
    """The plain reference of `gemv_gated` (float32 dots and epilogue, x's dtype out)."""
    dims = (((1,), (1,)), ((), ()))
    g = lax.dot_general(x, w_gate, dims, preferred_element_type=jnp.float32)
    u = lax.dot_general(x, w_up, dims, preferred_element_type=jnp.float32)
    return (act(g) * u).astype(x.dtype)


def multi_gemv_config(
    policy: str, m: int, ns: tuple[int, ...], k: int, x_dtype: jnp.dtype, w_dtype: jnp.dtype
) -> GemvConfig | None:
    """The config `gemv_multi` runs sibling weights [n_i, k] with under `policy`, or None (each
    its own path): every weight alone must take the GEMV (`decode_gemv_config`), then the merged
    pick (TUNED_MULTI, else `default_config` of the smallest n) must tile every n."""
    if any(decode_gemv_config(policy, m, n, k, x_dtype, w_dtype) is None for n in ns):
        return None
    cfg = TUNED_MULTI.get((sum(ns), k)) or default_config(min(ns), k)
    return cfg if all(gemv_supported(m, n, k, cfg) for n in ns) else None


def gated_gemv_config(
    policy: str, m: int, n: int, k: int, x_dtype: jnp.dtype, w_dtype: jnp.dtype
) -> GemvConfig | None:
    """The config `gemv_gated` runs gate / up [n, k] with under `policy`, or None: the weight
    alone must take the GEMV, then TUNED_GATED's pick (else `default_config`, split-K 1)."""
    if decode_gemv_config(policy, m, n, k, x_dtype, w_dtype) is None:
        return None
    cfg = TUNED_GATED.get((n, k)) or dataclasses.replace(default_config(n, k), split_k=1)
    return cfg if cfg.split_k == 1 and gemv_supported(m, n, k, cfg) else None
