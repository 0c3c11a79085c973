"""The XLA runner's compiled programs: what each one computes (`make_jitted`), how one is
lowered for a bucket (`lower_program`) and how the start-up set is compiled (`compile_programs`:
lowering one by one, compiling in threads, with a progress bar).

Kinds: FORWARD (one per token bucket T), SAMPLE and VERIFY (one per request bucket B),
PROMPT_LOGPROBS (one per token bucket, compiled the first time a step asks for it). SAMPLE is the
general sampler (runtime conditionals); `sample_kind(mode)` names its specializations
(sampler.SampleMode, no conditional: no host round trip on XLA:GPU).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from tqdm.auto import tqdm

from xlaserve.backends_xla.exec_cache import executable_cache
from xlaserve.backends_xla.sampler import (
    GREEDY,
    SampleMode,
    host_tensors,
    pack_params,
    sample,
    sampler_words,
    token_logprobs,
    unpack_params,
    verify,
)
from xlaserve.models_flax.attention import AttentionMetadata

if TYPE_CHECKING:
    from xlaserve.backends_xla.runner import XlaModelRunner

logger = logging.getLogger(__name__)

FORWARD, SAMPLE, PROMPT_LOGPROBS, VERIFY = "forward", "sample", "prompt_logprobs", "verify"
PROMPT_LOGPROBS_CHUNK = 512  # rows of [rows, V] logits materialized at once for prompt logprobs
SMALLEST_PACKED_T = 1  # any T: lowering SAMPLE only needs a batch's sample_params region
# Every sampler specialization (2^4 branch combinations).
SAMPLE_MODES = tuple(SampleMode(*(bool(i >> k & 1) for k in range(4))) for i in range(16))


def sample_kind(mode: SampleMode | None) -> str:
    """Program kind of a sampler: SAMPLE (general) for None, else "sample.<tag>"."""
    return SAMPLE if mode is None else f"{SAMPLE}.{mode.tag}"


SAMPLE_GREEDY = sample_kind(GREEDY)


@dataclass
class StepBatch:
    """Host arrays of one padded step (T tokens, R = max_num_seqs request rows).

    Every int32 field is a view into ONE flat buffer, `packed` (layout: `step_layout`), so a step
    costs one host -> device copy; the forward program slices it apart with static offsets."""

    packed: np.ndarray  # i32 [L]: the fields below, back to back
    # i32 [NS * R + 2] (sampler.SMALL_FIELDS): the SAMPLE program's per-row parameters; the
    # forward passes this region through to it on the device.
    sample_params: np.ndarray
    input_ids: np.ndarray  # i32 [T]
    positions: np.ndarray  # i32 [T]
    slot_mapping: np.ndarray  # i32 [T], -1 = padding
    kv_lens: np.ndarray  # i32 [R]
    block_tables: np.ndarray  # i32 [R, M]
    cu_q_lens: np.ndarray  # i32 [R+1]
    num_seqs: np.ndarray  # i32 [1]
    # i32 [R * (1 + K)]: rows [0, R) = last token of each request in T; with speculation
    # (K drafts max) rows R + i*K + j = draft position j of request i (padding: its last token).
    logits_indices: np.ndarray
    # i32 [R] each (async scheduling): input_ids[feed_dst[k]] = previous launch's tokens
    # [feed_src[k]] on the device; feed_dst = T (out of range) for unused entries.
    feed_dst: np.ndarray
    feed_src: np.ndarray
    # i32 [T] (multi-LoRA): each token's adapter slot, -1 = base model and padding.
    lora_slots: np.ndarray
    req_ids: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # first position computed this step
    counts: list[int] = field(default_factory=list)  # tokens computed this step
    sampling: list[bool] = field(default_factory=list)  # chunk reaches the end of known tokens
    drafts: list[list[int]] = field(default_factory=list)  # speculative drafts per request
    # i32 [R]: recurrent-state slot per request row (state-space models; padding rows: the slot
    # count, so their writes drop); None for attention-only models.
    state_slots: np.ndarray | None = None


# StepBatch's packed fields in buffer order; shapes in terms of T, R, M (blocks per request),
# N (= R * (1 + K) gathered rows) and S (the sampler's packed parameter words).
_PACKED = ("sample_params", "input_ids", "positions", "slot_mapping", "kv_lens", "block_tables",
           "cu_q_lens", "num_seqs", "logits_indices", "feed_dst", "feed_src", "lora_slots")  # fmt: skip
_PER_TOKEN = 4  # fields of shape (t,): input_ids, positions, slot_mapping, lora_slots


def step_layout(t: int, r: int, m: int, n: int) -> list[tuple[str, tuple[int, ...]]]:
    """(field, shape) of each packed StepBatch field, in buffer order."""
    shapes = {"sample_params": (sampler_words(r),), "input_ids": (t,), "positions": (t,),
              "slot_mapping": (t,), "kv_lens": (r,), "block_tables": (r, m), "cu_q_lens": (r + 1,),
              "num_seqs": (1,), "logits_indices": (n,), "feed_dst": (r,), "feed_src": (r,),
              "lora_slots": (t,)}  # fmt: skip
    return [(name, shapes[name]) for name in _PACKED]


@functools.lru_cache(maxsize=128)
def _step_slices(t: int, r: int, m: int, n: int) -> tuple[tuple[str, int, int, tuple], ...]:
    """(field, offset, size, shape) of each packed field: computed once per bucket, not per step."""
    out, off = [], 0
    for name, shape in step_layout(t, r, m, n):
        size = int(np.prod(shape))
        out.append((name, off, size, tuple(shape)))
        off += size
    return tuple(out)


def unpack_step(packed: jax.Array | np.ndarray, t: int, r: int, m: int, n: int) -> dict:
    """Split a packed buffer (host or traced) into its fields (static slices)."""
    return {
        name: packed[off : off + size].reshape(shape)
        for name, off, size, shape in _step_slices(t, r, m, n)
    }


@functools.lru_cache(maxsize=64)
def _dummy_packed(t: int, r: int, max_blocks: int, num_rows: int) -> np.ndarray:
    """The packed buffer of `dummy_batch` (read-only; built once per bucket)."""
    size = sum(s for _, _, s, _ in _step_slices(t, r, max_blocks, num_rows))
    packed = np.zeros(size, np.int32)
    f = unpack_step(packed, t, r, max_blocks, num_rows)
    f["slot_mapping"][:] = -1
    f["lora_slots"][:] = -1
    f["feed_dst"][:] = t
    pack_params(host_tensors(r, 1, extras=False), f["sample_params"])
    packed.setflags(write=False)
    return packed


def dummy_batch(t: int, r: int, max_blocks: int, num_rows: int) -> StepBatch:
    """An all-padding batch of token bucket t: no cache writes, no real request, greedy. A copy
    of a per-bucket template (the runner builds one every step; building it anew was several
    times slower than the copy)."""
    packed = _dummy_packed(t, r, max_blocks, num_rows).copy()
    return StepBatch(packed, **unpack_step(packed, t, r, max_blocks, num_rows))


def make_jitted(
    graphdef: nnx.GraphDef,
    treedef: jax.tree_util.PyTreeDef,
    kv_layer_shardings: tuple[NamedSharding, ...],
    replicated: NamedSharding,
    dims: tuple[int, int, int],
    num_spec_tokens: int,
    md_static: dict,
    lora: tuple[int, str] | None = None,
) -> dict[str, Callable]:
    """kind -> jitted function (not yet lowered). Programs take the model weights as the flat
    leaf list of the nnx.State (`treedef` rebuilds it while tracing): flattening a list costs
    microseconds per call, the nested State up to a millisecond for an 8B model. dims = (R, M, N):
    request rows, blocks per request, gathered rows. The forward donates the KV cache (argument 1)
    and pins its shardings so the donated cache always matches. md_static: AttentionMetadata's
    static fields (mesh, impl). lora: (slots, impl) with multi-LoRA: the forward groups the
    packed per-token `lora_slots` once and every projection with slot tables adds its delta."""
    rep = replicated
    r, m, n = dims

    def model_of(leaves):  # noqa: ANN001, ANN202
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    def forward(leaves, kv_caches, packed, prev, state_slots):  # noqa: ANN001, ANN202
        """packed: i32 [L] (step_layout); prev: i32 [R], the last SAMPLE program's tokens (async
        scheduling feeds the inputs that were still on the device); state_slots: i32 [R] for
        state-space models, else None."""
        fixed = sum(int(np.prod(s)) for _, s in step_layout(0, r, m, n))
        t = (packed.shape[0] - fixed) // _PER_TOKEN
        f = unpack_step(packed, t, r, m, n)
        lora_md = None
        if lora is not None:
            from xlaserve.kernels_pallas.lora import make_segments
            from xlaserve.models_flax.layers import LoRAStep

            lora_md = LoRAStep(make_segments(f["lora_slots"], lora[0]), lora[1])
        input_ids = f["input_ids"].at[f["feed_dst"]].set(prev[f["feed_src"]], mode="drop")
        md = AttentionMetadata(f["slot_mapping"], f["kv_lens"], f["block_tables"], f["cu_q_lens"],
                               f["num_seqs"], state_slots=state_slots, lora=lora_md,
                               **md_static)  # fmt: skip
        hidden, kv_caches = model_of(leaves)(input_ids, f["positions"], kv_caches, md)
        # Pin shardings so the donated cache and the next programs' inputs always match.
        kv_caches = [
            tuple(
                jax.lax.with_sharding_constraint(c, sh)
                for c, sh in zip(kv, kv_layer_shardings, strict=True)
            )
            for kv in kv_caches
        ]
        hidden = jax.lax.with_sharding_constraint(hidden, rep)
        return hidden[f["logits_indices"]], hidden, kv_caches, f["sample_params"]

    def logits_and_sample(leaves, rows, params, dense, mode=None):  # noqa: ANN001, ANN202
        b = dense["bias"].shape[0]  # the request bucket; rows is [R, H]
        st = unpack_params(params, r, b, dense)
        res = sample(model_of(leaves).compute_logits(rows[:b]), st, mode)
        # The tokens padded to R rows: the next forward's `prev` (one shape for every b).
        return res, jnp.pad(res.token_ids.astype(jnp.int32), (0, r - b))

    k = num_spec_tokens

    def logits_and_verify(leaves, rows, st, drafts, num_drafts):  # noqa: ANN001, ANN202
        b = drafts.shape[0]  # the request bucket; rows is [R * (1 + K), H]
        h = rows.shape[-1]
        pre = rows[r : r + b * k].reshape(b, k, h)
        full = jnp.concatenate([pre, rows[:b, None]], axis=1).reshape(b * (k + 1), h)
        return verify(model_of(leaves).compute_logits(full), st, drafts, num_drafts)

    def prompt_logprobs(leaves, hidden, targets):  # noqa: ANN001, ANN202
        model = model_of(leaves)
        t, c = hidden.shape[0], PROMPT_LOGPROBS_CHUNK
        if t <= c or t % c:
            return token_logprobs(model.compute_logits(hidden), targets)
        # Chunks of rows keep the [rows, V] logits small for big buckets and vocabularies.
        out = jax.lax.map(
            lambda ht: token_logprobs(model.compute_logits(ht[0]), ht[1]),
            (hidden.reshape(t // c, c, -1), targets.reshape(t // c, c)),
        )
        return jax.tree.map(lambda x: x.reshape(t, *x.shape[2:]), out)

    return {
        FORWARD: jax.jit(forward, donate_argnums=(1,)),
        SAMPLE: jax.jit(logits_and_sample),
        **{
            sample_kind(m): jax.jit(functools.partial(logits_and_sample, mode=m))
            for m in SAMPLE_MODES
        },
        PROMPT_LOGPROBS: jax.jit(prompt_logprobs),
        VERIFY: jax.jit(logits_and_verify),
    }


def lower_program(r: XlaModelRunner, kind: str, n: int) -> jax.stages.Lowered:
    """Trace and lower one program for bucket n (T for FORWARD/PROMPT_LOGPROBS, B for
    SAMPLE/VERIFY)."""
    if r.draft is not None and kind.startswith("draft_"):
        return r.draft.lower(kind, n)
    fn = r._jitted[kind]
    if kind == FORWARD:
        # The caches as shapes: a background compile (compile_all) lowers while steps donate
        # and replace r.kv_caches; a donated array keeps its shape, dtype and sharding.
        kv = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), r.kv_caches
        )
        lowered = fn.lower(r.weights, kv, *r._device_inputs(r._dummy_batch(n)))
        r._hidden_dtype = lowered.out_info[1].dtype
        return lowered
    h = r.spec.hidden_size
    if kind == VERIFY or kind.startswith(SAMPLE):
        rows = jax.ShapeDtypeStruct((r.num_rows, h), r._hidden_dtype, sharding=r._replicated)
        if kind != VERIFY:
            params = r._dummy_batch(SMALLEST_PACKED_T).sample_params
            return fn.lower(r.weights, rows, r._put(params), r._dense_extras({}, n))
        m = n * (1 + r.num_spec_tokens)
        st = r._put_sampling(host_tensors(m, r.vocab, False), m)
        drafts = r._put(np.zeros((n, r.num_spec_tokens), np.int32))
        return fn.lower(r.weights, rows, st, drafts, r._put(np.zeros(n, np.int32)))
    hidden = jax.ShapeDtypeStruct((n, h), r._hidden_dtype, sharding=r._replicated)
    targets = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=r._replicated)
    return fn.lower(r.weights, hidden, targets)  # fmt: skip


def compile_programs(
    r: XlaModelRunner, programs: list[tuple[str, int]], progress: bool = True
) -> None:
    """Compile `programs`: each one loaded from the executable cache when there, else lowered
    (one by one: tracing holds the GIL) and compiled in a thread (XLA releases it) while the next
    is lowered, with a progress bar unless `progress` is False (background compiles)."""
    todo = [p for p in programs if p not in r.programs]
    cache = executable_cache(r)
    if cache is not None:  # a warm start: serialized executables, no tracing
        for p in todo:
            compiled = cache.load(*p)
            if compiled is not None:
                r.programs[p] = compiled
                if p[0] == FORWARD:  # what lowering the forward would have set
                    r._hidden_dtype = compiled.out_info[1].dtype
        # Samplers are lowered after a forward (they read its hidden dtype): keep the order.
        missed = [p for p in todo if p not in r.programs]
        loaded = len(todo) - len(missed)
        r.exec_cache_loads += loaded
        todo = missed
        if loaded:
            logger.info("loaded %d XLA programs from the executable cache", loaded)
    if not todo:
        return
    workers = max(1, min(len(todo), os.cpu_count() or 1))
    with (
        ThreadPoolExecutor(workers) as pool,
        tqdm(
            total=len(todo),
            desc="Compiling XLA programs",
            unit="program",
            leave=False,
            disable=not progress,
        ) as bar,  # fmt: skip
    ):
        # Each program compiles while the next one is traced (cold start-up: the compiles of
        # the first programs overlap the tracing of the rest instead of waiting for all of it).
        futures = {pool.submit(_timed_compile, r, lower_program(r, *p), p): p for p in todo}
        for fut in as_completed(futures):
            r.programs[futures[fut]] = fut.result()
            bar.update()
    if cache is not None:  # serialized off the start-up path; shutdown waits for the writes
        cache.store_later([(*p, r.programs[p]) for p in todo])
        r.exec_cache_writers.append(cache)
    logger.info(
        "compiled %d XLA programs%s (%d token buckets %s, %d request buckets %s)",
        len(todo), "" if progress else " in the background", len(r.token_buckets),
        r.token_buckets, len(r.seq_buckets), r.seq_buckets,
    )  # fmt: skip


# The most matmul rows a program may have to compile without autotuning when
# KernelConfig.xla_autotune_small_programs is off: the smallest decode bucket (batch 1-16), whose
# projections run the Pallas decode GEMV anyway. Not 256: untuned, XLA's GEMMs of the batch-256
# decode step took 203 ms a step against 14.2 ms tuned (H200, 8B shape, 2026-12-05,
# bench/RESULTS.md); at 16 the cold start-up is 25.0 s to ready and the steps are the tuned ones.
UNTUNED_MAX_ROWS = 16


def compile_options(r: XlaModelRunner, kind: str, n: int) -> dict[str, int] | None:
    """Per-program XLA compile options for program (kind, bucket n): autotuning off for the
    programs of at most UNTUNED_MAX_ROWS matmul rows when KernelConfig.xla_autotune_small_programs
    is False (VERIFY scores n * (1 + K) rows), else None. An XLA debug option: every platform
    takes it, only the GPU compiler reads it."""
    if r.config.kernels.xla_autotune_small_programs:
        return None
    rows = n * (1 + r.num_spec_tokens) if kind == VERIFY else n
    return {"xla_gpu_autotune_level": 0} if rows <= UNTUNED_MAX_ROWS else None


def compile_program(
    r: XlaModelRunner, lowered: jax.stages.Lowered, kind: str, n: int
) -> jax.stages.Compiled:
    """lowered.compile() with the program's `compile_options`."""
    return lowered.compile(compile_options(r, kind, n))


def _timed_compile(
    r: XlaModelRunner, lowered: jax.stages.Lowered, key: tuple[str, int]
) -> jax.stages.Compiled:
    """`compile_program`, its seconds kept in r.compile_seconds[key] (bench/xla_startup.py)."""
    t0 = time.perf_counter()
    compiled = compile_program(r, lowered, *key)
    r.compile_seconds[key] = time.perf_counter() - t0
    return compiled


# Executable-cache kind of the forward that peak_activation_bytes compiles (never served).
PEAK_FORWARD = "peak_forward"


def peak_activation_bytes(r: XlaModelRunner) -> int:
    """Temporary memory of the largest forward + sampler, from XLA's memory analysis."""
    t, b = r.token_buckets[-1], r.seq_buckets[-1]
    sampler_bytes = 6 * b * r.vocab * 4
    kv = [kv_layer_structs(r, 1)] * r.spec.num_layers
    args = r._device_inputs(r._dummy_batch(t))
    try:
        cache = executable_cache(r)  # the largest forward over a 1-block cache, for its stats
        compiled = cache.load(PEAK_FORWARD, t) if cache is not None else None
        if compiled is None:
            compiled = _timed_compile(r, r._jitted[FORWARD].lower(r.weights, kv, *args),
                                      (PEAK_FORWARD, t))  # fmt: skip
            if cache is not None:
                cache.store_later([(PEAK_FORWARD, t, compiled)])
                r.exec_cache_writers.append(cache)
        stats = compiled.memory_analysis()
        return int(stats.temp_size_in_bytes + stats.output_size_in_bytes) + sampler_bytes
    except Exception:  # noqa: BLE001 - memory analysis is optional on some backends
        h, i = r.spec.hidden_size, r.spec.intermediate_size
        return 4 * t * (6 * h + 3 * i + 2 * r.vocab) + sampler_bytes


def kv_layer_structs(r: XlaModelRunner, num_blocks: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes, dtypes and shardings of one layer's cache tuple: (k, v) [N, S, Hkv, D] in the
    model dtype, or (k codes, v codes) int8 / float8_e4m3fn + (k scales, v scales) float32
    [N, S, Hkv] for a quantized cache (xlaserve.quantization.kv_quant)."""
    shape = (num_blocks, r.block_size, r.spec.num_kv_heads, r.spec.head_dim)
    if r.kv_cache_dtype == "auto":
        dtypes, shapes = (r.kv_dtype,) * 2, (shape,) * 2
    else:
        from xlaserve.kernels_pallas.kv_cache_quant import code_dtype

        dtypes = (code_dtype(r.kv_cache_dtype),) * 2 + (jnp.dtype(jnp.float32),) * 2
        shapes = (shape,) * 2 + (shape[:3],) * 2
    return tuple(
        jax.ShapeDtypeStruct(sh, dt, sharding=sd)
        for sh, dt, sd in zip(shapes, dtypes, r._kv_layer_shardings, strict=True)
    )
