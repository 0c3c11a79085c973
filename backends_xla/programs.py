"""The XLA runner's compiled programs: what each one computes (`make_jitted`), how one is
lowered for a bucket (`lower_program`) and how the start-up set is compiled (`compile_programs`:
lowering one by one, compiling in threads, with a progress bar).

Kinds: FORWARD (one per token bucket T), SAMPLE and VERIFY (one per request bucket B),
PROMPT_LOGPROBS (one per token bucket, compiled the first time a step asks for it).
"""

from __future__ import annotations

import logging
import os
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

from xlaserve.backends_xla.sampler import host_tensors, sample, token_logprobs, verify

if TYPE_CHECKING:
    from xlaserve.backends_xla.runner import XlaModelRunner

logger = logging.getLogger(__name__)

FORWARD, SAMPLE, PROMPT_LOGPROBS, VERIFY = "forward", "sample", "prompt_logprobs", "verify"
PROMPT_LOGPROBS_CHUNK = 512  # rows of [rows, V] logits materialized at once for prompt logprobs


@dataclass
class StepBatch:
    """Host arrays of one padded step (T tokens, R = max_num_seqs request rows)."""

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
    req_ids: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # first position computed this step
    counts: list[int] = field(default_factory=list)  # tokens computed this step
    sampling: list[bool] = field(default_factory=list)  # chunk reaches the end of known tokens
    drafts: list[list[int]] = field(default_factory=list)  # speculative drafts per request
    # i32 [R]: recurrent-state slot per request row (state-space models; padding rows: the slot
    # count, so their writes drop); None for attention-only models.
    state_slots: np.ndarray | None = None


def dummy_batch(t: int, r: int, max_blocks: int, num_rows: int) -> StepBatch:
    """An all-padding batch of token bucket t: no cache writes, no real request."""
    z = np.zeros
    return StepBatch(z(t, np.int32), z(t, np.int32), np.full(t, -1, np.int32), z(r, np.int32),
                  z((r, max_blocks), np.int32), z(r + 1, np.int32), z(1, np.int32),
                  z(num_rows, np.int32), np.full(r, t, np.int32), z(r, np.int32))  # fmt: skip


def make_jitted(
    graphdef: nnx.GraphDef,
    kv_layer_shardings: tuple[NamedSharding, ...],
    replicated: NamedSharding,
    max_num_seqs: int,
    num_spec_tokens: int,
) -> dict[str, Callable]:
    """kind -> jitted function (not yet lowered) over (state, ...). The forward donates the KV
    cache (argument 1) and pins its shardings so the donated cache always matches."""
    rep = replicated

    def forward(state, kv_caches, input_ids, positions, md, logits_indices, feed):  # noqa: ANN001, ANN202
        prev, dst, src = feed  # async scheduling: inputs still on the device
        input_ids = input_ids.at[dst].set(prev[src], mode="drop")
        model = nnx.merge(graphdef, state)
        hidden, kv_caches = model(input_ids, positions, kv_caches, md)
        # Pin shardings so the donated cache and the next programs' inputs always match.
        kv_caches = [
            tuple(
                jax.lax.with_sharding_constraint(c, sh)
                for c, sh in zip(kv, kv_layer_shardings, strict=True)
            )
            for kv in kv_caches
        ]
        hidden = jax.lax.with_sharding_constraint(hidden, rep)
        return hidden[logits_indices], hidden, kv_caches

    def logits_and_sample(state, rows, st):  # noqa: ANN001, ANN202
        b = st.temperature.shape[0]  # the request bucket; rows is [R, H]
        res = sample(nnx.merge(graphdef, state).compute_logits(rows[:b]), st)
        # The tokens padded to R rows: the next forward's `feed` (one shape for every b).
        return res, jnp.pad(res.token_ids.astype(jnp.int32), (0, max_num_seqs - b))

    r, k = max_num_seqs, num_spec_tokens

    def logits_and_verify(state, rows, st, drafts, num_drafts):  # noqa: ANN001, ANN202
        b = drafts.shape[0]  # the request bucket; rows is [R * (1 + K), H]
        h = rows.shape[-1]
        pre = rows[r : r + b * k].reshape(b, k, h)
        full = jnp.concatenate([pre, rows[:b, None]], axis=1).reshape(b * (k + 1), h)
        return verify(nnx.merge(graphdef, state).compute_logits(full), st, drafts, num_drafts)

    def prompt_logprobs(state, hidden, targets):  # noqa: ANN001, ANN202
        model = nnx.merge(graphdef, state)
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
        lowered = fn.lower(r.state, r.kv_caches, *r._device_inputs(r._dummy_batch(n)))
        r._hidden_dtype = lowered.out_info[1].dtype
        return lowered
    h = r.spec.hidden_size
    if kind in (SAMPLE, VERIFY):
        rows = jax.ShapeDtypeStruct((r.num_rows, h), r._hidden_dtype, sharding=r._replicated)
        if kind == SAMPLE:
            st = r._put_sampling(host_tensors(n, r.vocab, False), n)
            return fn.lower(r.state, rows, st)
        m = n * (1 + r.num_spec_tokens)
        st = r._put_sampling(host_tensors(m, r.vocab, False), m)
        drafts = r._put(np.zeros((n, r.num_spec_tokens), np.int32))
        return fn.lower(r.state, rows, st, drafts, r._put(np.zeros(n, np.int32)))
    hidden = jax.ShapeDtypeStruct((n, h), r._hidden_dtype, sharding=r._replicated)
    targets = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=r._replicated)
    return fn.lower(r.state, hidden, targets)  # fmt: skip


def compile_programs(r: XlaModelRunner, programs: list[tuple[str, int]]) -> None:
    """Compile `programs` (default: every start-up program), lowering one by one (tracing
    holds the GIL) and compiling in threads (XLA releases it), with a progress bar."""
    todo = [p for p in programs if p not in r.programs]
    lowered = {p: lower_program(r, *p) for p in todo}
    workers = max(1, min(len(todo), os.cpu_count() or 1, 8))
    with (
        ThreadPoolExecutor(workers) as pool,
        tqdm(total=len(todo), desc="Compiling XLA programs", unit="program", leave=False) as bar,
    ):
        futures = {pool.submit(low.compile): p for p, low in lowered.items()}
        for fut in as_completed(futures):
            r.programs[futures[fut]] = fut.result()
            bar.update()
    logger.info(
        "compiled %d XLA programs (%d token buckets %s, %d request buckets %s)",
        len(todo), len(r.token_buckets), r.token_buckets, len(r.seq_buckets), r.seq_buckets,
    )  # fmt: skip


def peak_activation_bytes(r: XlaModelRunner) -> int:
    """Temporary memory of the largest forward + sampler, from XLA's memory analysis."""
    t, b = r.token_buckets[-1], r.seq_buckets[-1]
    sampler_bytes = 6 * b * r.vocab * 4
    kv = [kv_layer_structs(r, 1)] * r.spec.num_layers
    args = r._device_inputs(r._dummy_batch(t))
    try:
        stats = r._jitted[FORWARD].lower(r.state, kv, *args).compile().memory_analysis()
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
