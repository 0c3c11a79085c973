"""XlaModelRunner: the JAX backend behind the ModelRunner protocol (src/xlaserve/runner.py).

One step = two compiled programs with static shapes, compiled apart so their counts add up
instead of multiplying:

- the forward, one per token bucket T: tokens padded to T; the per-request metadata (kv_lens,
  block tables, query offsets, last-token rows) padded to a FIXED R = max_num_seqs rows, which
  costs a few KB; the KV cache donated and updated in place. It returns the hidden rows of the
  last token of each request [R, H] (and all hidden states [T, H]).
- "logits + sample", one per request bucket B: the first B of those rows -> logits [B, V] ->
  one sampler program that handles every SamplingParams feature with arrays (sampler.py).

With a speculative_config (n-gram drafts, K = num_speculative_tokens) the forward gathers
R * (1 + K) rows instead of R and one "logits + verify" program per request bucket B (compiled at
start-up) scores 1 + K rows per request and accepts / rejects on the device (sampler.verify);
steps without drafts keep using the sample program. With method "draft_model" (draft.py) a
second model proposes the drafts after each step: one catch-up program per token bucket and one
K-step proposal program per request bucket, also compiled at start-up.

Prompt logprobs (rare) use a third program per token bucket, compiled the first time a step asks
for them (`lazy_compiles` records it). Everything else is compiled ahead of time at
`init_kv_cache` (unless `enforce_eager`: then each program is compiled at first use), as
`jax.stages.Compiled` executables, which cannot silently recompile while serving; JAX's persistent
compilation cache makes the next start-up fast. Per-request state persists across steps (a
persistent batch): the scheduler sends only what changed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from xlaserve.backends_xla.multihost import init_multihost
from xlaserve.backends_xla.sampler import (
    SamplerOutput,
    SamplingTensors,
    VerifyOutput,
    host_tensors,
    neutral_extras,
    sample,
    token_logprobs,
    verify,
)
from xlaserve.backends_xla.utils import (
    make_buckets,
    make_mesh,
    pick_bucket,
    resolve_dtype,
    setup_compilation_cache,
)
from xlaserve.config import EngineConfig
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax.attention import AttentionMetadata
from xlaserve.models_flax.loader import kv_heads_sharded, load_model, xla_quant_scheme
from xlaserve.runner import RunnerOutput, SchedulerOutput, TokenLogprobs
from xlaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SMALLEST_TOKEN_BUCKET = 16
PROMPT_LOGPROBS_CHUNK = 512  # rows of [rows, V] logits materialized at once for prompt logprobs
FORWARD, SAMPLE, PROMPT_LOGPROBS, VERIFY = "forward", "sample", "prompt_logprobs", "verify"


@dataclass
class _ReqState:
    token_ids: list[int]  # prompt + sampled tokens
    num_prompt: int
    params: SamplingParams
    block_ids: list[int]
    num_computed: int
    seed: int  # uint32 sampling seed: the request's own or drawn once by the runner
    output_counts: np.ndarray | None = None  # i32 [V], kept only when penalties are on
    prompt_mask: np.ndarray | None = None  # bool [V], kept only when penalties are on
    pending_row: int = -1  # row of the last launch's tokens holding this request's PENDING one

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt


@dataclass
class _Batch:
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


# Placeholder token id (async scheduling): sampled by a launched step not read back yet.
PENDING = -1
NAN_ERROR = "the model produced NaN logits"


@dataclass
class _Launched:
    """A launched step: its output so far; for a deferred SAMPLE step, the device results and
    (request id, state, index of its PENDING token, batch row) for `finish` to fill in."""

    out: RunnerOutput
    res: SamplerOutput | None = None
    pending: list[tuple[str, _ReqState, int, int]] = field(default_factory=list)


class XlaModelRunner:
    """See the module docstring. Constructed as `XlaModelRunner(config, spec)`."""

    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        # Multi-host (nnodes > 1): join jax.distributed before any JAX backend starts (multihost.py).
        self.multihost = init_multihost(config)
        # Quantized KV cache (int8 / fp8 codes + a float32 scale per token and KV head).
        self.kv_cache_dtype = config.cache.kv_cache_dtype
        # Weight quantization (None = float): the checkpoint's own format or `quantization`
        # applied at load time; raises early for fp8 without fp8 matmuls (models_flax/loader.py).
        self.quant_scheme = xla_quant_scheme(config.model.quantization, spec, config.kernels)
        sc = config.speculative
        if sc is not None and sc.method not in ("ngram", "draft_model"):
            raise NotImplementedError(
                f"speculative method {sc.method!r} is not supported by backend 'xla' "
                "(only 'ngram' and 'draft_model')"
            )
        # K: the verify programs score 1 + K rows per request (fixed shapes, compiled at start).
        self.num_spec_tokens = sc.num_speculative_tokens if sc is not None else 0
        self.config, self.spec = config, spec
        self.compilation_cache_dir = setup_compilation_cache(config.compilation_cache_dir)
        self.platform = jax.default_backend()
        self.dtype = resolve_dtype(config.model.dtype, spec.checkpoint_dtype, self.platform)
        # XLA:CPU upcasts a 16-bit gather/scatter operand to float32 as a whole (float
        # normalization), so a bf16/fp16 cache would be copied in full on every step (measured:
        # 18 vs 739 tok/s with 131k vs 1k blocks). On CPU the float cache is float32.
        self.kv_dtype = (
            jnp.dtype(jnp.float32)
            if self.platform == "cpu" and self.dtype.itemsize < 4
            else self.dtype
        )
        self.mesh = make_mesh(config.parallel.tensor_parallel_size)
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len or spec.max_position_embeddings
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        sched = config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        self.token_buckets = make_buckets(SMALLEST_TOKEN_BUCKET, sched.max_num_batched_tokens)
        self.seq_buckets = make_buckets(1, sched.max_num_seqs)
        self.vocab = spec.vocab_size
        self.num_rows = self.max_num_seqs * (1 + self.num_spec_tokens)  # forward's gathered rows
        self.requests: dict[str, _ReqState] = {}
        self._seed_rng = np.random.default_rng(config.model.seed)
        self._replicated = NamedSharding(self.mesh, P())
        # The last SAMPLE program's tokens, padded to max_num_seqs (async scheduling feeds them
        # to the next forward); zeros before the first step.
        self._last_tokens = jax.device_put(np.zeros(self.max_num_seqs, np.int32), self._replicated)
        kv_axis = "model" if kv_heads_sharded(spec, self.mesh) else None
        self._kv_sharding = NamedSharding(self.mesh, P(None, None, kv_axis, None))
        # One layer's cache tuple: (k, v), or (k codes, v codes, k scales, v scales) with the
        # [N, S, Hkv] scales split over KV heads like their codes.
        self._kv_layer_shardings = (self._kv_sharding,) * 2
        if self.kv_cache_dtype != "auto":
            scale_sharding = NamedSharding(self.mesh, P(None, None, kv_axis))
            self._kv_layer_shardings += (scale_sharding,) * 2
        self.graphdef: nnx.GraphDef | None = None
        self.state: nnx.State | None = None
        self.kv_caches: list[tuple[jax.Array, ...]] | None = None
        self.num_kv_blocks = 0
        self.kv_offload = None  # host/disk tier copy engine (kv_offload.py), set by init_kv_cache
        # (kind, bucket) -> compiled executable; kinds FORWARD (T), SAMPLE (B), PROMPT_LOGPROBS (T).
        self.programs: dict[tuple[str, int], jax.stages.Compiled] = {}
        self.lazy_compiles: list[tuple[str, int]] = []  # programs compiled after start-up
        self._neutral: dict[int, dict[str, jax.Array]] = {}  # B -> device-resident neutral extras
        self._hidden_dtype: jnp.dtype = self.dtype
        # method "draft_model": the draft's weights, KV cache and programs (draft.py).
        self.draft = None
        if sc is not None and sc.method == "draft_model":
            from xlaserve.backends_xla.draft import XlaDraftModel

            self.draft = XlaDraftModel(self, sc.model)

    # ---------------------------------------------------------------- set-up
    def load_model(self) -> None:
        self.graphdef, self.state = load_model(
            self.spec, self.dtype, self.mesh, self.config.load.load_format, self.config.model.seed,
            quant=self.quant_scheme, expert_parallel=self.config.parallel.enable_expert_parallel,
            kernels=self.config.kernels,
        )  # fmt: skip
        graphdef, rep = self.graphdef, self._replicated

        def forward(state, kv_caches, input_ids, positions, md, logits_indices, feed):  # noqa: ANN001, ANN202
            prev, dst, src = feed  # async scheduling: inputs still on the device
            input_ids = input_ids.at[dst].set(prev[src], mode="drop")
            model = nnx.merge(graphdef, state)
            hidden, kv_caches = model(input_ids, positions, kv_caches, md)
            # Pin shardings so the donated cache and the next programs' inputs always match.
            kv_caches = [
                tuple(
                    jax.lax.with_sharding_constraint(c, sh)
                    for c, sh in zip(kv, self._kv_layer_shardings, strict=True)
                )
                for kv in kv_caches
            ]
            hidden = jax.lax.with_sharding_constraint(hidden, rep)
            return hidden[logits_indices], hidden, kv_caches

        def logits_and_sample(state, rows, st):  # noqa: ANN001, ANN202
            b = st.temperature.shape[0]  # the request bucket; rows is [R, H]
            res = sample(nnx.merge(graphdef, state).compute_logits(rows[:b]), st)
            # The tokens padded to R rows: the next forward's `feed` (one shape for every b).
            return res, jnp.pad(res.token_ids.astype(jnp.int32), (0, self.max_num_seqs - b))

        r, k = self.max_num_seqs, self.num_spec_tokens

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

        self._jitted = {
            FORWARD: jax.jit(forward, donate_argnums=(1,)),
            SAMPLE: jax.jit(logits_and_sample),
            PROMPT_LOGPROBS: jax.jit(prompt_logprobs),
            VERIFY: jax.jit(logits_and_verify),
        }
        if self.draft is not None:
            self.draft.load()

    def _kv_block_bytes(self) -> int:
        """Bytes one KV block takes on one device."""
        shards = self.mesh.shape["model"] if kv_heads_sharded(self.spec, self.mesh) else 1
        per_token = self.spec.kv_bytes_per_token(self.kv_dtype.itemsize, self.kv_cache_dtype)
        return self.block_size * per_token // shards

    def _kv_layer_structs(self, num_blocks: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Shapes, dtypes and shardings of one layer's cache tuple: (k, v) [N, S, Hkv, D] in the
        model dtype, or (k codes, v codes) int8 / float8_e4m3fn + (k scales, v scales) float32
        [N, S, Hkv] for a quantized cache (xlaserve.quantization.kv_quant)."""
        shape = (num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        if self.kv_cache_dtype == "auto":
            dtypes, shapes = (self.kv_dtype,) * 2, (shape,) * 2
        else:
            from xlaserve.kernels_pallas.kv_cache_quant import code_dtype

            dtypes = (code_dtype(self.kv_cache_dtype),) * 2 + (jnp.dtype(jnp.float32),) * 2
            shapes = (shape,) * 2 + (shape[:3],) * 2
        return tuple(
            jax.ShapeDtypeStruct(sh, dt, sharding=sd)
            for sh, dt, sd in zip(shapes, dtypes, self._kv_layer_shardings, strict=True)
        )

    def determine_num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        draft_bytes = self.draft.kv_bytes_per_block() if self.draft is not None else 0
        block_bytes = (self._kv_block_bytes() + draft_bytes) * (
            self.mesh.shape["model"] if self.platform == "cpu" else 1
        )
        if self.platform == "cpu":
            n = cache.cpu_kv_cache_bytes // block_bytes
        else:
            free = min(
                d.memory_stats()["bytes_limit"] * cache.gpu_memory_utilization
                - d.memory_stats()["bytes_in_use"]
                for d in self.mesh.local_devices  # this host's (multi-host: the others' are remote)
            )
            n = int((free - self._peak_activation_bytes()) // block_bytes)
        if n < 1:
            raise ValueError(
                "no memory left for the KV cache: lower max_num_batched_tokens or raise gpu_memory_utilization"
            )
        return int(n) if self.multihost is None else self.multihost.min_over_hosts(int(n))

    def _peak_activation_bytes(self) -> int:
        """Temporary memory of the largest forward + sampler, from XLA's memory analysis."""
        t, b = self.token_buckets[-1], self.seq_buckets[-1]
        sampler_bytes = 6 * b * self.vocab * 4
        kv = [self._kv_layer_structs(1)] * self.spec.num_layers
        args = self._device_inputs(self._dummy_batch(t))
        try:
            stats = self._jitted[FORWARD].lower(self.state, kv, *args).compile().memory_analysis()
            return int(stats.temp_size_in_bytes + stats.output_size_in_bytes) + sampler_bytes
        except Exception:  # noqa: BLE001 - memory analysis is optional on some backends
            h, i = self.spec.hidden_size, self.spec.intermediate_size
            return 4 * t * (6 * h + 3 * i + 2 * self.vocab) + sampler_bytes

    def init_kv_cache(self, num_blocks: int) -> None:
        if self.state is None:
            raise RuntimeError("call load_model() before init_kv_cache()")
        structs = self._kv_layer_structs(num_blocks)
        layers = self.spec.num_layers
        alloc = jax.jit(
            lambda: [tuple(jnp.zeros(x.shape, x.dtype) for x in structs) for _ in range(layers)],
            out_shardings=[self._kv_layer_shardings] * layers,
        )
        self.kv_caches = alloc()
        self.num_kv_blocks = num_blocks
        if self.draft is not None:  # its own cache, same block ids (+ scratch blocks)
            self.draft.init_kv_cache(num_blocks)
        from xlaserve.backends_xla.kv_offload import make_xla_kv_offload

        self.kv_offload = make_xla_kv_offload(self)
        if not self.config.enforce_eager:
            self.compile_all()
        if self.multihost is not None:  # follower hosts serve host 0's steps here, then exit
            self.multihost.serve_if_follower(self)

    def startup_programs(self) -> list[tuple[str, int]]:
        """Programs compiled at start-up: (token buckets) + (request buckets), no product; with
        speculation also one verify program per request bucket."""
        progs = [(FORWARD, t) for t in self.token_buckets] + [(SAMPLE, b) for b in self.seq_buckets]
        if self.num_spec_tokens:
            progs += [(VERIFY, b) for b in self.seq_buckets]
        if self.draft is not None:  # + draft catch-up per token bucket, proposal per request bucket
            progs += self.draft.startup_programs()
        return progs

    def _lower(self, kind: str, n: int) -> jax.stages.Lowered:
        """Trace and lower one program for bucket n (T for FORWARD/PROMPT_LOGPROBS, B for
        SAMPLE/VERIFY)."""
        if self.draft is not None and kind.startswith("draft_"):
            return self.draft.lower(kind, n)
        fn = self._jitted[kind]
        if kind == FORWARD:
            lowered = fn.lower(
                self.state, self.kv_caches, *self._device_inputs(self._dummy_batch(n))
            )
            self._hidden_dtype = lowered.out_info[1].dtype
            return lowered
        h = self.spec.hidden_size
        if kind in (SAMPLE, VERIFY):
            rows = jax.ShapeDtypeStruct(
                (self.num_rows, h), self._hidden_dtype, sharding=self._replicated
            )
            if kind == SAMPLE:
                st = self._put_sampling(host_tensors(n, self.vocab, False), n)
                return fn.lower(self.state, rows, st)
            m = n * (1 + self.num_spec_tokens)
            st = self._put_sampling(host_tensors(m, self.vocab, False), m)
            drafts = self._put(np.zeros((n, self.num_spec_tokens), np.int32))
            return fn.lower(self.state, rows, st, drafts, self._put(np.zeros(n, np.int32)))
        hidden = jax.ShapeDtypeStruct((n, h), self._hidden_dtype, sharding=self._replicated)
        targets = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self._replicated)
        return fn.lower(self.state, hidden, targets)  # fmt: skip

    def compile_all(self, programs: list[tuple[str, int]] | None = None) -> None:
        """Compile `programs` (default: every start-up program), lowering one by one (tracing
        holds the GIL) and compiling in threads (XLA releases it), with a progress bar."""
        todo = [p for p in (programs or self.startup_programs()) if p not in self.programs]
        lowered = {p: self._lower(*p) for p in todo}
        workers = max(1, min(len(todo), os.cpu_count() or 1, 8))
        with (
            ThreadPoolExecutor(workers) as pool,
            tqdm(
                total=len(todo), desc="Compiling XLA programs", unit="program", leave=False
            ) as bar,
        ):
            futures = {pool.submit(low.compile): p for p, low in lowered.items()}
            for fut in as_completed(futures):
                self.programs[futures[fut]] = fut.result()
                bar.update()
        logger.info(
            "compiled %d XLA programs (%d token buckets %s, %d request buckets %s)",
            len(todo), len(self.token_buckets), self.token_buckets, len(self.seq_buckets), self.seq_buckets,
        )  # fmt: skip

    def _program(self, kind: str, n: int) -> jax.stages.Compiled:
        prog = self.programs.get((kind, n))
        if prog is None:
            if kind != PROMPT_LOGPROBS and not self.config.enforce_eager:
                logger.warning("compiling %s program for bucket %d while serving", kind, n)
            self.lazy_compiles.append((kind, n))
            prog = self.programs[(kind, n)] = self._lower(kind, n).compile()
        return prog

    def shutdown(self) -> None:
        if self.multihost is not None:
            self.multihost.stop()
        self.requests.clear()
        self.kv_caches = None
        self.state = None
        self.programs.clear()
        self._neutral.clear()
        if self.draft is not None:
            self.draft.shutdown()

    # ---------------------------------------------------------------- one step
    @property
    def async_by_default(self) -> bool:
        """async_scheduling="auto": on for a single host. JAX dispatch returns before the
        device is done, so the host work of the next step overlaps it (measured on the CPU:
        1.23x at batch 1, 1.13x at batch 8, `python -m xlaserve.bench.async_ab`)."""
        return self.multihost is None

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.finish(self._launch(scheduler_output, defer=False))

    def launch(self, scheduler_output: SchedulerOutput) -> _Launched:
        """Dispatch one step; a plain SAMPLE step's tokens are read by `finish` (runner.py)."""
        return self._launch(scheduler_output, defer=self.multihost is None)

    def finish(self, launched: _Launched) -> RunnerOutput:
        """Read a deferred step's tokens back; fill its PENDING placeholders."""
        h, out = launched, launched.out
        if not h.pending:
            return out
        res = jax.device_get(h.res)
        for rid, r, idx, i in h.pending:
            if res.has_nan[i]:
                out.errors[rid] = NAN_ERROR
                continue
            tok = int(res.token_ids[i])
            if self.requests.get(rid) is r:  # else finished/preempted since: nothing to fill
                r.token_ids[idx] = tok
            out.sampled_token_ids[rid] = [tok]
            if r.params.logprobs is not None:
                out.logprobs[rid] = self._logprobs(res, r, i, 1)
        h.pending, h.res = [], None
        return out

    def _launch(self, scheduler_output: SchedulerOutput, defer: bool) -> _Launched:
        so = scheduler_output
        if self.multihost is not None:  # host 0: the followers run this step too
            self.multihost.before_execute(so)
        stray = [r for r, d in so.spec_token_ids.items() if d and r not in so.num_scheduled_tokens]
        if stray:
            raise ValueError(f"speculative drafts for requests not scheduled this step: {stray}")
        if any(so.spec_token_ids.values()) and not self.num_spec_tokens:
            raise ValueError("speculative drafts scheduled but no speculative_config was set")
        if so.has_kv_copies:  # before the forward, in the order runner.py documents
            if self.kv_offload is None:
                raise RuntimeError("KV offload copies scheduled but kv_offload_bytes is 0")
            self.kv_caches = self.kv_offload.apply(
                self.kv_caches, so.kv_disk_out, so.kv_copy_out, so.kv_disk_in, so.kv_copy_in
            )
        self._update_states(so)
        out = RunnerOutput()
        launched = _Launched(out)
        if so.total_num_scheduled_tokens == 0 or not so.num_scheduled_tokens:
            return launched
        batch = self._prepare(so)
        rows_h, hidden = self._forward(batch)
        if any(batch.drafts):
            self._verify_step(so, batch, rows_h, hidden, out)
            self._propose_drafts(batch, out)
            return launched
        b = pick_bucket(self.seq_buckets, len(batch.req_ids))
        rows = [
            self.requests[r] if s else None
            for r, s in zip(batch.req_ids, batch.sampling, strict=True)
        ]
        rows += [None] * (b - len(rows))
        extras = any(
            self._needs_extras(r, rid, so) for r, rid in zip(rows, batch.req_ids, strict=False)
        )
        with_lp = any(r is not None and r.params.logprobs is not None for r in rows)
        st = self._sampling_tensors(rows, batch.req_ids, b, extras, with_lp, so.grammar_bitmask)
        res, self._last_tokens = self._program(SAMPLE, b)(self.state, rows_h, st)
        if defer and self._deferrable(rows):
            self._defer(batch, res, launched)
            return launched
        res = jax.device_get(res)
        self._prompt_logprobs(batch, hidden, out)
        self._emit(batch, res, out, lambda i: [int(res.token_ids[i])], lambda i: i)
        self._propose_drafts(batch, out)
        return launched

    def _deferrable(self, rows: list[_ReqState | None]) -> bool:
        """Tokens may stay on the device: nothing this step reads them on the host (no draft
        model, no prompt logprobs, no penalties whose counts the host keeps)."""
        if self.draft is not None:
            return False
        for r in rows:
            if r is not None and (
                r.output_counts is not None or r.params.prompt_logprobs is not None
            ):
                return False
        return True

    def _defer(self, batch: _Batch, res: SamplerOutput, launched: _Launched) -> None:
        """Bookkeeping of `_emit` without the tokens: each sampling request gets a PENDING token
        (row i of this launch's tokens), fed to the next launch on the device."""
        launched.res = res
        for i, rid in enumerate(batch.req_ids):
            r = self.requests[rid]
            r.num_computed += batch.counts[i]
            if not batch.sampling[i]:
                launched.out.sampled_token_ids[rid] = []
                continue
            launched.pending.append((rid, r, len(r.token_ids), i))
            r.token_ids.append(PENDING)
            r.num_computed = len(r.token_ids) - 1
            r.pending_row = i

    def _propose_drafts(self, batch: _Batch, out: RunnerOutput) -> None:
        """With a draft model: its catch-up and proposals for the next step (draft.py)."""
        if self.draft is not None:
            out.spec_token_ids = self.draft.propose(batch, out)

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for nr in so.new_requests:
            p = nr.sampling_params
            seed = p.seed if p.seed is not None else int(self._seed_rng.integers(0, 2**32))
            r = _ReqState(list(nr.token_ids), nr.num_prompt_tokens, p, list(nr.block_ids), nr.num_computed_tokens,
                          seed & 0xFFFFFFFF)  # fmt: skip
            if p.needs_penalties:
                r.prompt_mask = np.zeros(self.vocab, bool)
                r.prompt_mask[[t for t in r.token_ids[: r.num_prompt] if t < self.vocab]] = True
                r.output_counts = np.bincount(
                    [t for t in r.token_ids[r.num_prompt :] if t < self.vocab], minlength=self.vocab
                ).astype(np.int32)
            self.requests[nr.req_id] = r
        for cr in so.cached_requests:
            r = self.requests.get(cr.req_id)
            if r is None:
                raise KeyError(
                    f"cached request {cr.req_id!r} unknown to the runner (never sent as new)"
                )
            r.block_ids.extend(cr.new_block_ids)
            if cr.num_computed_tokens != r.num_computed:
                logger.debug(
                    "%s: num_computed_tokens %d (runner had %d)",
                    cr.req_id,
                    cr.num_computed_tokens,
                    r.num_computed,
                )
                r.num_computed = cr.num_computed_tokens

    def _append(self, r: _ReqState, tok: int) -> None:
        r.token_ids.append(tok)
        if r.output_counts is not None and tok < self.vocab:
            r.output_counts[tok] += 1

    def _prepare(self, so: SchedulerOutput) -> _Batch:
        items = list(so.num_scheduled_tokens.items())
        total = sum(n for _, n in items)
        if len(items) > self.max_num_seqs:
            raise ValueError(
                f"{len(items)} requests in one step exceed max_num_seqs {self.max_num_seqs}"
            )
        batch = self._dummy_batch(pick_bucket(self.token_buckets, total))
        s, off, num_feeds = self.block_size, 0, 0
        for i, (rid, n) in enumerate(items):
            r = self.requests[rid]
            c = r.num_computed
            ds = list(so.spec_token_ids.get(rid, ()))
            if len(ds) > self.num_spec_tokens:
                raise ValueError(
                    f"{rid}: {len(ds)} drafts exceed num_speculative_tokens {self.num_spec_tokens}"
                )
            known = r.token_ids + ds if ds else r.token_ids
            if c + n > len(known):
                raise ValueError(
                    f"{rid}: {n} tokens scheduled from {c} but only {len(known)} are known"
                )
            if ds and c + n != len(known):
                raise ValueError(f"{rid}: {len(ds)} drafts scheduled but the chunk ends at {c + n}")
            blocks = np.asarray(r.block_ids, np.int32)
            if len(blocks) * s < c + n or len(blocks) > self.max_blocks_per_seq:
                raise ValueError(
                    f"{rid}: {len(blocks)} blocks cannot hold {c + n} tokens (max_model_len {self.max_model_len})"
                )
            pos = np.arange(c, c + n, dtype=np.int32)
            batch.input_ids[off : off + n] = known[c : c + n]
            if known[c + n - 1] == PENDING:  # sampled by the launch still in flight
                batch.feed_dst[num_feeds] = off + n - 1
                batch.feed_src[num_feeds] = r.pending_row
                num_feeds += 1
            batch.positions[off : off + n] = pos
            batch.slot_mapping[off : off + n] = blocks[pos // s] * s + pos % s
            batch.kv_lens[i] = c + n
            batch.block_tables[i, : len(blocks)] = blocks
            off += n
            batch.cu_q_lens[i + 1 :] = off
            batch.logits_indices[i] = off - 1
            k, d = self.num_spec_tokens, len(ds)
            for j in range(k):  # draft positions j < d score row off-1-d+j; padding: the last
                batch.logits_indices[self.max_num_seqs + i * k + j] = off - 1 - d + min(j, d)
            batch.req_ids.append(rid)
            batch.starts.append(c)
            batch.counts.append(n)
            batch.sampling.append(c + n == len(known))
            batch.drafts.append(ds)
        batch.num_seqs[0] = len(items)
        return batch

    def _dummy_batch(self, t: int) -> _Batch:
        """An all-padding batch of token bucket t: no cache writes, no real request."""
        z, r = np.zeros, self.max_num_seqs
        return _Batch(z(t, np.int32), z(t, np.int32), np.full(t, -1, np.int32), z(r, np.int32),
                      z((r, self.max_blocks_per_seq), np.int32), z(r + 1, np.int32), z(1, np.int32),
                      z(self.num_rows, np.int32), np.full(r, t, np.int32), z(r, np.int32))  # fmt: skip

    def _put(self, tree):  # noqa: ANN001, ANN202
        """Host arrays -> replicated device arrays (one sharding always, as compiled)."""
        return jax.device_put(tree, self._replicated)

    def _device_inputs(self, batch: _Batch) -> tuple:
        ids, pos, slots, kv_lens, tables, cu, ns, li, dst, src = self._put(
            (batch.input_ids, batch.positions, batch.slot_mapping, batch.kv_lens, batch.block_tables,
             batch.cu_q_lens, batch.num_seqs, batch.logits_indices, batch.feed_dst, batch.feed_src)
        )  # fmt: skip
        md = AttentionMetadata(
            slots, kv_lens, tables, cu, ns, mesh=self.mesh, impl=self.config.kernels.rpa_impl
        )
        return ids, pos, md, li, (self._last_tokens, dst, src)

    def _forward(self, batch: _Batch) -> tuple[jax.Array, jax.Array]:
        """Run the model; keeps the (donated) cache; returns last-token rows [R, H], hidden [T, H]."""
        rows, hidden, self.kv_caches = self._program(FORWARD, len(batch.input_ids))(
            self.state, self.kv_caches, *self._device_inputs(batch)
        )
        return rows, hidden

    # ---------------------------------------------------------------- sampling inputs
    def _needs_extras(self, r: _ReqState | None, rid: str, so: SchedulerOutput) -> bool:
        if r is None:
            return False
        p = r.params
        return bool(
            p.logit_bias
            or p.needs_penalties
            or rid in so.grammar_bitmask
            or p.masks_stop_tokens(r.num_output)
        )

    def _put_sampling(self, host: dict[str, np.ndarray], b: int) -> SamplingTensors:
        """Host fields -> SamplingTensors on the device; dense fields missing from `host` are
        the bucket's device-resident neutral ones (copied once)."""
        if b not in self._neutral:
            self._neutral[b] = self._put(neutral_extras(b, self.vocab))
        return SamplingTensors(**{**self._neutral[b], **self._put(host)})

    def _sampling_tensors(
        self,
        rows: list[_ReqState | None],
        req_ids: list[str],
        b: int,
        extras: bool,
        with_logprobs: bool,
        bitmasks: dict,
        positions: list[int] | None = None,
        prefixes: list[list[int]] | None = None,
    ) -> SamplingTensors:
        """Padded per-row parameters; rows that do not sample this step (None) are greedy.
        bitmasks: req_id -> i32 [positions, W] (row 0 is this step's). With speculation, row i
        scores position positions[i] after the drafts prefixes[i] (counts, steps, bitmask row)."""
        v = self.vocab
        h = host_tensors(b, v, extras)
        h["use_extras"], h["want_logprobs"] = np.asarray(extras), np.asarray(with_logprobs)
        for i, r in enumerate(rows):
            if r is None:
                continue
            p = r.params
            j = positions[i] if positions is not None else 0
            n_out = r.num_output + j
            h["temperature"][i], h["top_k"][i], h["top_p"][i] = p.temperature, p.top_k, p.top_p
            h["min_p"][i], h["seeds"][i], h["steps"][i] = p.min_p, r.seed, n_out
            h["repetition_penalty"][i] = p.repetition_penalty
            h["frequency_penalty"][i] = p.frequency_penalty
            h["presence_penalty"][i] = p.presence_penalty
            if not extras:
                continue
            for tok, val in (p.logit_bias or {}).items():
                if 0 <= tok < v:
                    h["bias"][i, tok] += val
            if n_out < p.min_tokens:
                stop = [t for t in p.all_stop_token_ids() if 0 <= t < v]
                h["bias"][i, stop] = -np.inf
            if req_ids[i] in bitmasks:
                w = h["bitmask"].shape[1]
                mask = np.asarray(bitmasks[req_ids[i]], np.int32).reshape(-1, w)
                if mask.shape[0] <= j:
                    raise ValueError(
                        f"{req_ids[i]}: grammar bitmask has {mask.shape[0]} rows, position {j} scored"
                    )
                h["bitmask"][i] = mask[j]
            if r.output_counts is not None:
                h["output_counts"][i], h["prompt_mask"][i] = r.output_counts, r.prompt_mask
                for tok in prefixes[i] if prefixes is not None else ():
                    if 0 <= tok < v:
                        h["output_counts"][i, tok] += 1
        if extras:  # copy only the dense fields some row uses; the others stay device-resident
            live = [(i, r) for i, r in enumerate(rows) if r is not None]
            if not any(req_ids[i] in bitmasks for i, _ in live):
                del h["bitmask"]
            if not any(r.output_counts is not None for _, r in live):
                del h["output_counts"], h["prompt_mask"]
            pos = positions if positions is not None else [0] * len(rows)
            if not any(
                r.params.logit_bias or r.num_output + pos[i] < r.params.min_tokens for i, r in live
            ):
                del h["bias"]
        return self._put_sampling(h, b)

    def _verify_step(
        self,
        so: SchedulerOutput,
        batch: _Batch,
        rows_h: jax.Array,
        hidden: jax.Array,
        out: RunnerOutput,
    ) -> None:
        """A step with drafts: one verify program over 1 + K rows per request (padded)."""
        k = self.num_spec_tokens
        b = pick_bucket(self.seq_buckets, len(batch.req_ids))
        reqs: list[_ReqState | None] = []
        rids: list[str] = []
        positions: list[int] = []
        prefixes: list[list[int]] = []
        drafts = np.zeros((b, k), np.int32)
        num_drafts = np.zeros(b, np.int32)
        for i in range(b):
            live = i < len(batch.req_ids) and batch.sampling[i]
            r = self.requests[batch.req_ids[i]] if live else None
            ds = batch.drafts[i] if live else []
            drafts[i, : len(ds)], num_drafts[i] = ds, len(ds)
            for j in range(k + 1):
                jj = min(j, len(ds))  # padding rows repeat the last real position
                reqs.append(r)
                rids.append(batch.req_ids[i] if live else "")
                positions.append(jj)
                prefixes.append(ds[:jj])
        extras = any(self._needs_extras(r, rid, so) for r, rid in zip(reqs, rids, strict=True))
        with_lp = any(r is not None and r.params.logprobs is not None for r in reqs)
        st = self._sampling_tensors(
            reqs, rids, len(reqs), extras, with_lp, so.grammar_bitmask, positions, prefixes
        )
        res = jax.device_get(
            self._program(VERIFY, b)(
                self.state, rows_h, st, self._put(drafts), self._put(num_drafts)
            )
        )
        self._prompt_logprobs(batch, hidden, out)
        self._emit(
            batch,
            res,
            out,
            lambda i: [int(t) for t in res.token_ids[i, : int(res.num_tokens[i])]],
            lambda i: i * (k + 1),
        )

    def _emit(
        self,
        batch: _Batch,
        res: SamplerOutput | VerifyOutput,
        out: RunnerOutput,
        tokens: Callable[[int], list[int]],
        first_row: Callable[[int], int],
    ) -> None:
        """Record a step's results (SAMPLE or VERIFY program output `res`) in `out`: request i of
        the batch gets `tokens(i)` (one sampled token, or the accepted drafts + one), whose
        logprobs sit in rows first_row(i), first_row(i) + 1, ... of `res`."""
        for i, rid in enumerate(batch.req_ids):
            r = self.requests[rid]
            r.num_computed += batch.counts[i]
            if not batch.sampling[i]:
                out.sampled_token_ids[rid] = []
                continue
            if res.has_nan[i]:
                out.errors[rid] = NAN_ERROR
                continue
            toks = tokens(i)
            for tok in toks:
                self._append(r, tok)
            # KV is valid up to the last accepted token; the new last token is computed next.
            r.num_computed = len(r.token_ids) - 1
            out.sampled_token_ids[rid] = toks
            if r.params.logprobs is not None:
                out.logprobs[rid] = self._logprobs(res, r, first_row(i), len(toks))

    @staticmethod
    def _logprobs(
        res: SamplerOutput | VerifyOutput, r: _ReqState, lo: int, n: int
    ) -> list[TokenLogprobs]:
        """The request's TokenLogprobs of result rows lo .. lo + n - 1 (host arrays)."""
        m = 1 + r.params.logprobs
        return [
            TokenLogprobs(
                res.logprob_ids[j, :m].tolist(), res.logprobs[j, :m].tolist(), int(res.ranks[j])
            )
            for j in range(lo, lo + n)
        ]

    def _prompt_logprobs(self, batch: _Batch, hidden: jax.Array, out: RunnerOutput) -> None:
        """Logprobs of prompt tokens whose preceding position was computed this step."""
        # (rid, row of the chunk's first token in T, first position computed, target positions [lo, hi))
        wanted = []
        off = 0
        for rid, c, n in zip(batch.req_ids, batch.starts, batch.counts, strict=True):
            r = self.requests[rid]
            lo, hi = c + 1, min(c + n + 1, r.num_prompt)
            if r.params.prompt_logprobs is not None and hi > lo:
                wanted.append((rid, off - c, lo, hi))  # row of target position p: off - c + p - 1
            off += n
        if not wanted:
            return
        t = len(batch.input_ids)
        targets = np.zeros(t, np.int32)
        for rid, base, lo, hi in wanted:
            targets[base + lo - 1 : base + hi - 1] = self.requests[rid].token_ids[lo:hi]
        prog = self._program(PROMPT_LOGPROBS, t)
        lps, ids, ranks = jax.device_get(prog(self.state, hidden, self._put(targets)))
        for rid, base, lo, hi in wanted:
            k = 1 + self.requests[rid].params.prompt_logprobs
            rows = range(base + lo - 1, base + hi - 1)
            out.prompt_logprobs[rid] = [
                TokenLogprobs(ids[j, :k].tolist(), lps[j, :k].tolist(), int(ranks[j])) for j in rows
            ]
