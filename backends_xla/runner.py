"""XlaModelRunner: the JAX backend behind the ModelRunner protocol (src/xlaserve/runner.py).

One step = two jitted calls with static shapes: the model forward (tokens padded to a token
bucket T, requests to a request bucket B; the KV cache donated and updated in place) and the
sampler (B rows). Every (T, B) combination a step can produce is compiled at `init_kv_cache`
(unless `enforce_eager`), so serving never compiles; JAX's persistent compilation cache makes the
next start-up fast. Per-request state persists across steps (a persistent batch): the scheduler
sends only what changed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm
from xlaserve.backends_xla.sampler import SamplingTensors, sample, token_logprobs
from xlaserve.backends_xla.utils import (
    make_buckets,
    make_mesh,
    pick_bucket,
    resolve_dtype,
    setup_compilation_cache,
)
from xlaserve.models_flax.attention import AttentionMetadata
from xlaserve.models_flax.loader import kv_heads_sharded, load_model

from xlaserve.config import EngineConfig
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.runner import RunnerOutput, SchedulerOutput, TokenLogprobs
from xlaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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
    extra: dict = field(default_factory=dict)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt


@dataclass
class _Batch:
    """Host arrays of one padded step, plus which rows sample."""

    input_ids: np.ndarray  # i32 [T]
    positions: np.ndarray  # i32 [T]
    slot_mapping: np.ndarray  # i32 [T], -1 = padding
    kv_lens: np.ndarray  # i32 [B]
    block_tables: np.ndarray  # i32 [B, M]
    cu_q_lens: np.ndarray  # i32 [B+1]
    num_seqs: np.ndarray  # i32 [1]
    logits_indices: np.ndarray  # i32 [B]: last token of each request in T
    req_ids: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # first position computed this step
    counts: list[int] = field(default_factory=list)  # tokens computed this step
    sampling: list[bool] = field(default_factory=list)  # chunk reaches the end of known tokens


class XlaModelRunner:
    """See the module docstring. Constructed as `XlaModelRunner(config, spec)`."""

    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        if config.cache.kv_cache_dtype != "auto":
            raise ValueError(
                f"kv_cache_dtype {config.cache.kv_cache_dtype!r} is not supported by backend 'xla'"
            )
        if config.model.quantization is not None:
            raise ValueError(
                f"quantization {config.model.quantization!r} is not supported by backend 'xla'"
            )
        self.config, self.spec = config, spec
        self.compilation_cache_dir = setup_compilation_cache(config.compilation_cache_dir)
        self.platform = jax.default_backend()
        self.dtype = resolve_dtype(config.model.dtype, spec.checkpoint_dtype, self.platform)
        self.mesh = make_mesh(config.parallel.tensor_parallel_size)
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len or spec.max_position_embeddings
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        sched = config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        self.token_buckets = make_buckets(16, sched.max_num_batched_tokens)
        self.seq_buckets = make_buckets(1, sched.max_num_seqs)
        self.vocab = spec.vocab_size
        self.requests: dict[str, _ReqState] = {}
        self._seed_rng = np.random.default_rng(config.model.seed)
        self._replicated = NamedSharding(self.mesh, P())
        kv_axis = "model" if kv_heads_sharded(spec, self.mesh) else None
        self._kv_sharding = NamedSharding(self.mesh, P(None, None, kv_axis, None))
        self.graphdef: nnx.GraphDef | None = None
        self.state: nnx.State | None = None
        self.kv_caches: list[tuple[jax.Array, jax.Array]] | None = None
        self.num_kv_blocks = 0
        self._sample_fn = jax.jit(sample, static_argnames=("with_logprobs",))

    # ---------------------------------------------------------------- set-up
    def load_model(self) -> None:
        self.graphdef, self.state = load_model(
            self.spec, self.dtype, self.mesh, self.config.load.load_format, self.config.model.seed
        )
        graphdef = self.graphdef

        def forward(state, kv_caches, input_ids, positions, md, logits_indices):  # noqa: ANN001, ANN202
            model = nnx.merge(graphdef, state)
            hidden, kv_caches = model(input_ids, positions, kv_caches, md)
            # Pin the cache's sharding so the donated input and the output always match.
            kv_caches = [
                tuple(jax.lax.with_sharding_constraint(c, self._kv_sharding) for c in kv)
                for kv in kv_caches
            ]
            return model.compute_logits(hidden[logits_indices]), hidden, kv_caches

        def prompt_logprobs(state, hidden, targets):  # noqa: ANN001, ANN202
            return token_logprobs(nnx.merge(graphdef, state).compute_logits(hidden), targets)

        self._forward_fn = jax.jit(forward, donate_argnums=(1,))
        self._prompt_lp_fn = jax.jit(prompt_logprobs)

    def _kv_block_bytes(self) -> int:
        """Bytes one KV block takes on one device."""
        shards = self.mesh.shape["model"] if kv_heads_sharded(self.spec, self.mesh) else 1
        return self.block_size * self.spec.kv_bytes_per_token(self.dtype.itemsize) // shards

    def determine_num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        block_bytes = self._kv_block_bytes() * (
            self.mesh.shape["model"] if self.platform == "cpu" else 1
        )
        if self.platform == "cpu":
            n = cache.cpu_kv_cache_bytes // block_bytes
        else:
            free = min(
                d.memory_stats()["bytes_limit"] * cache.gpu_memory_utilization
                - d.memory_stats()["bytes_in_use"]
                for d in self.mesh.devices.flat
            )
            n = int((free - self._peak_activation_bytes()) // block_bytes)
        if n < 1:
            raise ValueError(
                "no memory left for the KV cache: lower max_num_batched_tokens or raise gpu_memory_utilization"
            )
        return int(n)

    def _peak_activation_bytes(self) -> int:
        """Temporary memory of the largest forward + sampler, from XLA's memory analysis."""
        t, b = self.token_buckets[-1], self.seq_buckets[-1]
        batch = self._dummy_batch(t, b)
        kv = [(jax.ShapeDtypeStruct((1, self.block_size, self.spec.num_kv_heads, self.spec.head_dim), self.dtype,
                                    sharding=self._kv_sharding),) * 2] * self.spec.num_layers  # fmt: skip
        args = self._device_inputs(batch)
        try:
            stats = self._forward_fn.lower(self.state, kv, *args).compile().memory_analysis()
            return (
                int(stats.temp_size_in_bytes + stats.output_size_in_bytes) + 6 * b * self.vocab * 4
            )
        except Exception:  # noqa: BLE001 - memory analysis is optional on some backends
            h, i = self.spec.hidden_size, self.spec.intermediate_size
            return 4 * t * (6 * h + 3 * i + 2 * self.vocab) + 6 * b * self.vocab * 4

    def init_kv_cache(self, num_blocks: int) -> None:
        if self.state is None:
            raise RuntimeError("call load_model() before init_kv_cache()")
        shape = (num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        layers = self.spec.num_layers
        alloc = jax.jit(
            lambda: [
                (jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)) for _ in range(layers)
            ],
            out_shardings=self._kv_sharding,
        )
        self.kv_caches = alloc()
        self.num_kv_blocks = num_blocks
        if not self.config.enforce_eager:
            self._warm_up()

    def bucket_combinations(self) -> list[tuple[int, int]]:
        """(token bucket, request bucket) pairs a step can produce (B <= T always)."""
        out = []
        for t in self.token_buckets:
            b_max = pick_bucket(self.seq_buckets, min(t, self.max_num_seqs))
            out += [(t, b) for b in self.seq_buckets if b <= b_max]
        return out

    def _warm_up(self) -> None:
        """Compile (and run once on padding) every bucket: forward, sampler variants, prompt logprobs."""
        seen_t: set[int] = set()
        seen_b: set[int] = set()
        combos = self.bucket_combinations()
        for t, b in tqdm(combos, desc="Compiling XLA buckets", unit="bucket", leave=False):
            logits, hidden = self._forward(self._dummy_batch(t, b))
            if b not in seen_b:
                seen_b.add(b)
                for extras in (False, True):
                    st = self._put(self._sampling_tensors([None] * b, [], b, extras, {}))
                    for with_lp in (False, True):
                        self._sample_fn(logits, st, with_logprobs=with_lp)
            if t not in seen_t:
                seen_t.add(t)
                self._prompt_lp_fn(self.state, hidden, self._put(np.zeros(t, np.int32)))
        jax.block_until_ready(self.kv_caches)
        logger.info("compiled %d XLA bucket combinations", len(combos))

    def shutdown(self) -> None:
        self.requests.clear()
        self.kv_caches = None
        self.state = None

    # ---------------------------------------------------------------- one step
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        so = scheduler_output
        if so.spec_token_ids:
            raise NotImplementedError("speculative decoding is not supported by backend 'xla' yet")
        if so.kv_copy_in or so.kv_copy_out:
            raise NotImplementedError("KV offloading is not supported by backend 'xla' yet")
        self._update_states(so)
        out = RunnerOutput()
        if so.total_num_scheduled_tokens == 0 or not so.num_scheduled_tokens:
            return out
        batch = self._prepare(so)
        logits, hidden = self._forward(batch)
        b = len(batch.kv_lens)
        rows = [
            self.requests[r] if s else None
            for r, s in zip(batch.req_ids, batch.sampling, strict=True)
        ]
        rows += [None] * (b - len(rows))
        extras = any(
            self._needs_extras(r, rid, so) for r, rid in zip(rows, batch.req_ids, strict=False)
        )
        with_lp = any(r is not None and r.params.logprobs is not None for r in rows)
        st = self._put(self._sampling_tensors(rows, batch.req_ids, b, extras, so.grammar_bitmask))
        res = jax.device_get(self._sample_fn(logits, st, with_logprobs=with_lp))
        self._prompt_logprobs(batch, hidden, out)
        for i, rid in enumerate(batch.req_ids):
            r = self.requests[rid]
            r.num_computed += batch.counts[i]
            if not batch.sampling[i]:
                out.sampled_token_ids[rid] = []
                continue
            if res.has_nan[i]:
                out.errors[rid] = "the model produced NaN logits"
                continue
            tok = int(res.token_ids[i])
            self._append(r, tok)
            out.sampled_token_ids[rid] = [tok]
            if r.params.logprobs is not None:
                k = 1 + r.params.logprobs
                out.logprobs[rid] = [
                    TokenLogprobs(
                        res.logprob_ids[i, :k].tolist(),
                        res.logprobs[i, :k].tolist(),
                        int(res.ranks[i]),
                    )
                ]
        return out

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
        t, b = pick_bucket(self.token_buckets, total), pick_bucket(self.seq_buckets, len(items))
        batch = self._dummy_batch(t, b)
        s, off = self.block_size, 0
        for i, (rid, n) in enumerate(items):
            r = self.requests[rid]
            c = r.num_computed
            if c + n > len(r.token_ids):
                raise ValueError(
                    f"{rid}: {n} tokens scheduled from {c} but only {len(r.token_ids)} are known"
                )
            blocks = np.asarray(r.block_ids, np.int32)
            if len(blocks) * s < c + n or len(blocks) > self.max_blocks_per_seq:
                raise ValueError(
                    f"{rid}: {len(blocks)} blocks cannot hold {c + n} tokens (max_model_len {self.max_model_len})"
                )
            pos = np.arange(c, c + n, dtype=np.int32)
            batch.input_ids[off : off + n] = r.token_ids[c : c + n]
            batch.positions[off : off + n] = pos
            batch.slot_mapping[off : off + n] = blocks[pos // s] * s + pos % s
            batch.kv_lens[i] = c + n
            batch.block_tables[i, : len(blocks)] = blocks
            off += n
            batch.cu_q_lens[i + 1 :] = off
            batch.logits_indices[i] = off - 1
            batch.req_ids.append(rid)
            batch.starts.append(c)
            batch.counts.append(n)
            batch.sampling.append(c + n == len(r.token_ids))
        batch.num_seqs[0] = len(items)
        return batch

    def _dummy_batch(self, t: int, b: int) -> _Batch:
        """An all-padding batch of bucket (t, b): no cache writes, no real request."""
        z = np.zeros
        return _Batch(z(t, np.int32), z(t, np.int32), np.full(t, -1, np.int32), z(b, np.int32),
                      z((b, self.max_blocks_per_seq), np.int32), z(b + 1, np.int32), z(1, np.int32),
                      z(b, np.int32))  # fmt: skip

    def _put(self, tree):  # noqa: ANN001, ANN202
        """Host arrays -> replicated device arrays (one sharding always, so jit never re-keys)."""
        return jax.device_put(tree, self._replicated)

    def _device_inputs(self, batch: _Batch) -> tuple:
        ids, pos, slots, kv_lens, tables, cu, ns, li = self._put(
            (batch.input_ids, batch.positions, batch.slot_mapping, batch.kv_lens, batch.block_tables,
             batch.cu_q_lens, batch.num_seqs, batch.logits_indices)
        )  # fmt: skip
        return ids, pos, AttentionMetadata(slots, kv_lens, tables, cu, ns, mesh=self.mesh), li

    def _forward(self, batch: _Batch) -> tuple[jax.Array, jax.Array]:
        """Run the model; keeps the (donated) cache; returns logits [B, V] and hidden [T, H]."""
        logits, hidden, self.kv_caches = self._forward_fn(
            self.state, self.kv_caches, *self._device_inputs(batch)
        )
        return logits, hidden

    # ---------------------------------------------------------------- sampling inputs
    def _needs_extras(self, r: _ReqState | None, rid: str, so: SchedulerOutput) -> bool:
        if r is None:
            return False
        p = r.params
        return bool(
            p.logit_bias
            or p.needs_penalties
            or rid in so.grammar_bitmask
            or (r.num_output < p.min_tokens and p.all_stop_token_ids())
        )

    def _sampling_tensors(
        self, rows: list[_ReqState | None], req_ids: list[str], b: int, extras: bool, bitmasks: dict
    ) -> SamplingTensors:
        """Padded per-row parameters; rows that do not sample this step (None) are greedy.
        bitmasks: req_id -> i32 [positions, W] (row 0 is this step's)."""
        f32, v = np.float32, self.vocab
        temp, top_k, top_p = np.zeros(b, f32), np.zeros(b, np.int32), np.ones(b, f32)
        min_p, seeds, steps = np.zeros(b, f32), np.zeros(b, np.uint32), np.zeros(b, np.int32)
        rep, freq, pres = np.ones(b, f32), np.zeros(b, f32), np.zeros(b, f32)
        if extras:
            bias, bitmask = np.zeros((b, v), f32), np.full((b, -(-v // 32)), -1, np.int32)
            counts, pmask = np.zeros((b, v), np.int32), np.zeros((b, v), bool)
        for i, r in enumerate(rows):
            if r is None:
                continue
            p = r.params
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            seeds[i], steps[i] = r.seed, r.num_output
            rep[i], freq[i], pres[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
            if not extras:
                continue
            for tok, val in (p.logit_bias or {}).items():
                if 0 <= tok < v:
                    bias[i, tok] += val
            if r.num_output < p.min_tokens:
                stop = [t for t in p.all_stop_token_ids() if 0 <= t < v]
                bias[i, stop] = -np.inf
            if req_ids[i] in bitmasks:
                bitmask[i] = np.asarray(bitmasks[req_ids[i]], np.int32).reshape(
                    -1, bitmask.shape[1]
                )[0]
            if r.output_counts is not None:
                counts[i], pmask[i] = r.output_counts, r.prompt_mask
        dense = (
            dict(bias=bias, bitmask=bitmask, output_counts=counts, prompt_mask=pmask)
            if extras
            else {}
        )
        return SamplingTensors(temp, top_k, top_p, min_p, seeds, steps, rep, freq, pres, **dense)

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
        targets = np.zeros(len(batch.input_ids), np.int32)
        for rid, base, lo, hi in wanted:
            targets[base + lo - 1 : base + hi - 1] = self.requests[rid].token_ids[lo:hi]
        lps, ids, ranks = jax.device_get(self._prompt_lp_fn(self.state, hidden, self._put(targets)))
        for rid, base, lo, hi in wanted:
            k = 1 + self.requests[rid].params.prompt_logprobs
            rows = range(base + lo - 1, base + hi - 1)
            out.prompt_logprobs[rid] = [
                TokenLogprobs(ids[j, :k].tolist(), lps[j, :k].tolist(), int(ranks[j])) for j in rows
            ]
