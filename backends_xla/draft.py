"""Draft-model speculative decoding on the XLA backend (`speculative_config.method="draft_model"`).

A second, small Flax NNX model (same tokenizer, vocabulary no larger than the target's) runs
inside `XlaModelRunner.execute` after the target has sampled / verified, with its own paged KV
cache indexed by the SAME block ids as the target's (so prefix caching and preemption carry over:
whatever the target computed into a block, the draft computed into its own copy of that block),
plus a few scratch blocks per batch slot for proposal positions past a request's allocated
blocks. Same semantics as the torch runner (backends_torch/draft.py `propose`):

1. catch-up ("draft_prefill", one program per token bucket T): the draft writes its KV for the
   tokens the target computed this step that are now known to be right: positions
   [start, len - 1) of a request that sampled (accepted drafts included, the new last token
   excluded), [start, start + n) of a prefill chunk that did not sample. This never exceeds the
   target's own token count, so the target's token buckets fit it.
2. proposal ("draft_decode", one program per request bucket B): K greedy decode steps in one
   `lax.fori_loop`; step 0 feeds the request's last token (position len - 1, written into the
   draft cache for every request that sampled, so the draft's KV always covers what the target's
   covers), step j feeds draft j. Rows with quota q (never past max_tokens / max_model_len, the
   bonus token counts) write at most q positions; proposals past q are dropped on the host.

Drafts are greedy, so the draft distribution q is one-hot at the proposed token: that is what
`sampler.verify` assumes (accept with probability p(x), else resample p without x), which keeps
sampled (temperature > 0) outputs distributed exactly as the target's.

Per-request draft table (width M + scratch, M = max blocks per sequence): the request's block
ids, then its batch slot's scratch blocks (ids num_blocks + slot * scratch ...), zero padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.backends_xla.utils import pick_bucket
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.models_flax.attention import AttentionMetadata
from xlaserve.models_flax.loader import kv_heads_sharded, load_model
from xlaserve.runner import RunnerOutput
from xlaserve.runner_core import draft_quota

if TYPE_CHECKING:
    from xlaserve.backends_xla.programs import StepBatch
    from xlaserve.backends_xla.runner import XlaModelRunner, _ReqState

DRAFT_PREFILL, DRAFT_DECODE = "draft_prefill", "draft_decode"
DRAFT_KINDS = (DRAFT_PREFILL, DRAFT_DECODE)
# The K proposal steps: one rolled lax.fori_loop (False) or unrolled in the program (True).
DECODE_UNROLL = False


class XlaDraftModel:
    """The draft model of one `XlaModelRunner`: weights, KV cache, programs, proposals."""

    def __init__(self, runner: XlaModelRunner, model: str) -> None:
        from xlaserve.model_loader.registry import build_spec
        from xlaserve.model_loader.resolve import resolve_model_dir

        self.runner = runner
        cfg = runner.config
        self.spec: ModelSpec = build_spec(resolve_model_dir(model, None, cfg.load.download_dir))
        if self.spec.vocab_size > runner.spec.vocab_size:
            raise ValueError(
                f"draft model vocab ({self.spec.vocab_size}) is larger than the target's "
                f"({runner.spec.vocab_size}): the draft must share the target's tokenizer"
            )
        self.k = runner.num_spec_tokens
        self.block_size = runner.block_size
        # Scratch blocks per batch slot: the K positions past the last allocated block at most.
        self.scratch = -(-self.k // self.block_size) + 1
        self.slots = runner.max_num_seqs
        self.table_width = runner.max_blocks_per_seq + self.scratch
        mesh = runner.mesh
        kv_axis = "model" if kv_heads_sharded(self.spec, mesh) else None
        self._kv_shards = mesh.shape["model"] if kv_axis else 1
        kv_sharding = NamedSharding(mesh, P(None, None, kv_axis, None))
        self._kv_layer_shardings: tuple[NamedSharding, ...] = (kv_sharding,) * 2
        if runner.kv_cache_dtype != "auto":
            self._kv_layer_shardings += (NamedSharding(mesh, P(None, None, kv_axis)),) * 2
        self.graphdef: nnx.GraphDef | None = None
        self.state: nnx.State | None = None
        self.kv_caches: list[tuple[jax.Array, ...]] | None = None
        self.num_blocks = 0  # the target's; the draft cache has num_blocks + slots * scratch
        self._jitted: dict[str, object] = {}

    # ---------------------------------------------------------------- set-up
    def kv_bytes_per_block(self) -> int:
        """Bytes one block id costs the draft's cache on one device."""
        r = self.runner
        per_token = self.spec.kv_bytes_per_token(r.kv_dtype.itemsize, r.kv_cache_dtype)
        return self.block_size * per_token // self._kv_shards

    def load(self) -> None:
        r = self.runner
        self.graphdef, self.state = load_model(
            self.spec, r.dtype, r.mesh, r.config.load.load_format, r.config.model.seed + 1,
            kernels=r.config.kernels,
        )  # fmt: skip
        graphdef, shardings, s, k = self.graphdef, self._kv_layer_shardings, self.block_size, self.k
        mesh, rpa_impl = r.mesh, r.config.kernels.rpa_impl

        def pin(kv_caches):  # noqa: ANN001, ANN202 - donated cache keeps one sharding
            return [
                tuple(
                    jax.lax.with_sharding_constraint(c, sh)
                    for c, sh in zip(kv, shardings, strict=True)
                )
                for kv in kv_caches
            ]

        def prefill(state, kv_caches, input_ids, positions, md):  # noqa: ANN001, ANN202
            """Catch-up: write the draft's KV of [T] tokens (nothing else is used)."""
            _, kv_caches = nnx.merge(graphdef, state)(input_ids, positions, kv_caches, md)
            return pin(kv_caches)

        def decode(state, kv_caches, last, pos0, tables, quota, cu, num_seqs):  # noqa: ANN001, ANN202
            """K greedy steps over B rows. last/pos0/quota i32 [B]: last token, its position,
            drafts wanted; tables i32 [B, M']; cu i32 [B+1]; num_seqs i32 [1] (rows past it
            are padding). Returns drafts i32 [B, K] and the cache."""
            model = nnx.merge(graphdef, state)
            b = last.shape[0]
            live = jnp.arange(b) < num_seqs[0]
            writes = jnp.maximum(quota, 1)  # step 0 always writes the real last token

            def step(j, carry):  # noqa: ANN001, ANN202
                kv, tok, out = carry
                pos = pos0 + j
                page = jnp.take_along_axis(tables, jnp.minimum(pos // s, tables.shape[1] - 1)[:, None], 1)[:, 0]  # fmt: skip
                slot = jnp.where(live & (j < writes), page * s + pos % s, -1)
                md = AttentionMetadata(
                    slot, jnp.where(live, pos + 1, 0), tables, cu, num_seqs, mesh=mesh,
                    impl=rpa_impl,
                )  # fmt: skip
                hidden, kv = model(tok, pos, kv, md)
                nxt = jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32)
                return pin(kv), nxt, out.at[:, j].set(nxt)

            init = (kv_caches, last, jnp.zeros((b, k), jnp.int32))
            kv_caches, _, out = jax.lax.fori_loop(0, k, step, init, unroll=DECODE_UNROLL)
            return out, kv_caches

        self._jitted = {
            DRAFT_PREFILL: jax.jit(prefill, donate_argnums=(1,)),
            DRAFT_DECODE: jax.jit(decode, donate_argnums=(1,)),
        }

    def init_kv_cache(self, num_blocks: int) -> None:
        """Per layer (k, v) [N + slots * scratch, S, Hkv, D] (quantized: codes + scales, as the
        target's cache)."""
        r, n = self.runner, num_blocks + self.slots * self.scratch
        shape = (n, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        if r.kv_cache_dtype == "auto":
            structs = [(shape, r.kv_dtype)] * 2
        else:
            from xlaserve.kernels_pallas.kv_cache_quant import code_dtype

            code = code_dtype(r.kv_cache_dtype)
            structs = [(shape, code)] * 2 + [(shape[:3], jnp.dtype(jnp.float32))] * 2
        layers = self.spec.num_layers
        alloc = jax.jit(
            lambda: [tuple(jnp.zeros(sh, dt) for sh, dt in structs) for _ in range(layers)],
            out_shardings=[self._kv_layer_shardings] * layers,
        )
        self.kv_caches = alloc()
        self.num_blocks = num_blocks

    def startup_programs(self) -> list[tuple[str, int]]:
        r = self.runner
        return [(DRAFT_PREFILL, t) for t in r.token_buckets] + [
            (DRAFT_DECODE, b) for b in r.seq_buckets
        ]

    def lower(self, kind: str, n: int) -> jax.stages.Lowered:
        """Trace and lower one draft program for bucket n (T for prefill, B for decode)."""
        put = self.runner._put
        if kind == DRAFT_PREFILL:
            return self._jitted[kind].lower(
                self.state, self.kv_caches, *self._prefill_inputs([], n)
            )
        return self._jitted[kind].lower(self.state, self.kv_caches, *put(self._decode_host([], n)))

    def shutdown(self) -> None:
        self.kv_caches = None
        self.state = None

    # ---------------------------------------------------------------- host inputs
    def _table(self, block_ids: list[int], slot: int) -> np.ndarray:
        """i32 [M']: the request's blocks, then slot `slot`'s scratch blocks, zero padded."""
        base = self.num_blocks + slot * self.scratch
        row = np.zeros(self.table_width, np.int32)
        row[: len(block_ids)] = block_ids
        row[len(block_ids) : len(block_ids) + self.scratch] = np.arange(base, base + self.scratch)
        return row

    def _prefill_inputs(self, chunks: list[tuple[list[int], int, list[int]]], t: int) -> tuple:
        """chunks: (tokens, first position, block ids) -> device ids [T], positions [T], metadata
        (R = max_num_seqs rows, padding: slot -1, kv_len 0)."""
        r, s = self.runner, self.block_size
        rows = r.max_num_seqs
        ids, pos = np.zeros(t, np.int32), np.zeros(t, np.int32)
        slots = np.full(t, -1, np.int32)
        kv_lens, cu = np.zeros(rows, np.int32), np.zeros(rows + 1, np.int32)
        tables = np.zeros((rows, self.table_width), np.int32)
        off = 0
        for i, (toks, start, blocks) in enumerate(chunks):
            n = len(toks)
            p = np.arange(start, start + n, dtype=np.int32)
            tables[i] = self._table(blocks, i)
            ids[off : off + n], pos[off : off + n] = toks, p
            slots[off : off + n] = tables[i, p // s] * s + p % s
            kv_lens[i] = start + n
            off += n
            cu[i + 1 :] = off
        ids, pos, slots, kv_lens, tables, cu, ns = r._put(
            (ids, pos, slots, kv_lens, tables, cu, np.asarray([len(chunks)], np.int32))
        )
        md = AttentionMetadata(
            slots, kv_lens, tables, cu, ns, mesh=r.mesh, impl=r.config.kernels.rpa_impl
        )
        return ids, pos, md

    def _decode_host(self, rows: list[tuple[_ReqState, int]], b: int) -> tuple[np.ndarray, ...]:
        """rows: (request, quota) -> last, pos0, tables, quota, cu, num_seqs for bucket b."""
        last, pos0, quota = (np.zeros(b, np.int32) for _ in range(3))
        tables = np.zeros((b, self.table_width), np.int32)
        for i, (st, q) in enumerate(rows):
            last[i], pos0[i], quota[i] = st.token_ids[-1], len(st.token_ids) - 1, q
            tables[i] = self._table(st.block_ids, i)
        cu = np.minimum(np.arange(b + 1), len(rows)).astype(np.int32)
        return last, pos0, tables, quota, cu, np.asarray([len(rows)], np.int32)

    def _quota(self, st: _ReqState) -> int:
        """Drafts worth proposing (runner_core.draft_quota, as on torch)."""
        return draft_quota(st, self.k, self.runner.max_model_len)

    # ---------------------------------------------------------------- one step
    def propose(self, batch: StepBatch, out: RunnerOutput) -> dict[str, list[int]]:
        """After the target's step: catch the draft up, then propose up to K tokens for each
        request that sampled. Returns req id -> drafts (requests with quota 0 left out)."""
        r = self.runner
        chunks: list[tuple[list[int], int, list[int]]] = []
        rows: list[tuple[_ReqState, int]] = []
        rids: list[str] = []
        for i, rid in enumerate(batch.req_ids):
            st = r.requests[rid]
            c, n = batch.starts[i], batch.counts[i]
            ok = bool(out.sampled_token_ids.get(rid)) and rid not in out.errors
            stop = len(st.token_ids) - 1 if ok else min(c + n, len(st.token_ids))
            if stop > c:
                chunks.append((st.token_ids[c:stop], c, st.block_ids))
            if ok:
                rows.append((st, self._quota(st)))
                rids.append(rid)
        if chunks:
            t = pick_bucket(r.token_buckets, sum(len(x[0]) for x in chunks))
            self.kv_caches = r._program(DRAFT_PREFILL, t)(
                self.state, self.kv_caches, *self._prefill_inputs(chunks, t)
            )
        if not rows:
            return {}
        b = pick_bucket(r.seq_buckets, len(rows))
        drafts, self.kv_caches = r._program(DRAFT_DECODE, b)(
            self.state, self.kv_caches, *r._put(self._decode_host(rows, b))
        )
        drafts = np.asarray(jax.device_get(drafts))
        return {rid: drafts[i, :q].tolist() for i, (rid, (_, q)) in enumerate(zip(rids, rows, strict=True)) if q}  # fmt: skip
