"""GPU step execution for the Torch runner: packed metadata upload and decode CUDA graphs.

`CudaStepRunner.forward` takes the step's flat host lists (built by the runner) and returns the
model's hidden states [T, H]:

- every step: the int32 inputs (ids, positions, slots, query_start_loc, seq_lens, block table)
  are packed into one pinned host buffer with numpy and sent with ONE host->device copy; the
  attention metadata is built once per step (not per layer) and nothing in the forward syncs.
- decode-only steps (every request has one query token) of at most the largest bucket replay a
  CUDA graph captured for the padded batch size (1, 2, 4, ..., max_num_seqs). The graph reads
  static buffers; padding requests have seq_len 1, block 0 and slot -1 (no KV write), and their
  output rows are dropped. Sampling stays outside the graph. `enforce_eager=True` turns it off.
- recurrent-state models (Mamba, Mamba2, the hybrids, Qwen3-Next; backends_torch/state.py): the
  step's state slots and keep flags (0 = fresh request) are two more static buffers of the
  graph, turned into the models' `md.derived["state_tensors"]` inside it; padding rows read and
  write the runner's spare scratch slot with keep 0, never a request's slot. The state layers'
  decode path updates conv / SSM / delta-rule state in place in the slot tensors (whose
  addresses the graph holds) and never syncs with the host. Prefill / mixed steps run eagerly.
- CPU (tests only): no CUDA graphs exist, so a bucket's "graph" runs the very forward it would
  capture, on the same static buffers, at each replay (`_EagerReplay`): the buffer filling and
  padding logic is exercised without a GPU.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch

from xlaserve.backends_torch.layers.attention import AttentionBackend, AttentionMetadata
from xlaserve.config import kernel_switch

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]
# (slot per request, fresh flag per request) of a recurrent-state model's step, in batch order.
StepState = tuple[list[int], list[bool]]
# SM count assumed for split-KV choices on the CPU (graph emulation in tests): an H200's.
_CPU_SMS = 132


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: powers of 2 below max_num_seqs, then max_num_seqs."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    out.append(max_num_seqs)
    return out


def graph_kv_splits(
    bucket: int, num_kv_heads: int, group: int, num_sms: int, max_splits: int | None = None
) -> int:
    """Split-KV factor fixed at capture: fill ~2 programs per SM for small decode batches, at
    most max_splits (KernelConfig.graph_max_kv_splits; None: its default and environment
    override). (Empty splits cost one early-exit program; the merge weighs them 0.)"""
    block_q = max(16, 1 << (group - 1).bit_length()) // group  # the decode tile's BLOCK_Q
    programs = (bucket // block_q + bucket) * num_kv_heads
    if programs >= num_sms:
        return 1
    cap = max_splits if max_splits is not None else kernel_switch("graph_max_kv_splits")
    want = min(2 * num_sms // programs, cap)
    return 1 << (max(want, 1).bit_length() - 1)


class _Packed:
    """One pinned int32 host buffer and its device twin; views are carved per step (on the CPU,
    tests: a plain host buffer and a copy)."""

    def __init__(self, numel: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.empty(numel, dtype=torch.int32, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(numel, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event() if cuda else None
        self._pending = False

    def host_view(self) -> np.ndarray:
        """The host buffer, once the last upload from it has been read by the copy engine
        (steps that sample nothing never sync, so the next step could overwrite it early)."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False
        return self.host_np

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first n host ints to the device (async, on the current stream)."""
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._pending = True
        return self.dev


class _EagerReplay:
    """A bucket's stand-in for a CUDA graph on the CPU (tests): `replay` runs the forward the
    graph would have captured, on the same static buffers, into the same output tensor."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.out = fn()

    @torch.inference_mode()
    def replay(self) -> None:
        self.out.copy_(self.fn())


class CudaStepRunner:
    """Runs one step's forward on CUDA; owns the decode CUDA graphs of one runner."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[KVCache],
        *,
        hidden_size: int,
        dtype: torch.dtype,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_kv_heads: int,
        num_heads: int,
        use_graphs: bool,
        attn_backend: AttentionBackend,
        max_kv_splits: int | None = None,
        device: torch.device | None = None,
        state_scratch_slot: int | None = None,
    ) -> None:
        """device: the caches' device (default: kv_caches[0][0]'s; hybrids pass it, their first
        layer may hold nested caches). state_scratch_slot: recurrent-state models only, the
        spare state slot that padding rows and warm-up steps read and write (never a request's);
        None: a model without recurrent state."""
        if not attn_backend.cuda_graphs and use_graphs:
            raise ValueError(f"attention backend {attn_backend.name!r} has no CUDA graphs")
        self.attn_backend = attn_backend  # builds the step metadata (its metadata hooks)
        self.model = model
        self.max_kv_splits = max_kv_splits  # KernelConfig.graph_max_kv_splits
        self.kv_caches = kv_caches
        self.device = device if device is not None else kv_caches[0][0].device
        self.state_scratch = state_scratch_slot
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.block_size = block_size
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.max_num_seqs = max_num_seqs
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        # Eager-path upload buffer: ids, positions, slots [T] + qsl [B+1] + seq_lens [B] +
        # block table [B, M] (+ feed indices and rows [B] each), every segment 16-int aligned.
        t, b = max_num_batched_tokens, max(max_num_seqs, 1)
        self._eager = _Packed(_eager_layout(t, b, _pad16(self.max_blocks), b)[-1], self.device)
        self.buckets = decode_buckets(max_num_seqs) if use_graphs else []
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | _EagerReplay, torch.Tensor, int]] = {}
        self.capture_seconds = 0.0
        self.num_replays = 0  # decode steps served by a graph (tests and stats read it)
        self.bucket_replays: dict[int, int] = {}  # replays per bucket size (tests read it)
        self.num_eager = 0
        if self.buckets:
            self._setup_graph_buffers()

    # ---- eager (any step) ------------------------------------------------------------------

    def forward(
        self,
        chunks: list[tuple[list[int], int, list[int]]],
        feed: tuple[list[int], list[int], torch.Tensor] | None = None,
        state: StepState | None = None,
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """chunks: per request (token ids to compute, position of the first, block table).
        feed (async scheduling): (flat token indices, rows, tokens [R] on the device): input
        ids[index] = tokens[row], set on the device after the upload (those ids are placeholders
        on the host). state (recurrent-state models, required for them): (state slot [B], fresh
        [B]) per request (backends_torch/state.py `step_state`). Returns (hidden [T, H],
        query_start_loc host list [B+1], seq_lens host list [B])."""
        if (state is None) != (self.state_scratch is None):
            raise ValueError(
                "recurrent-state models need the step's state slots; other models take none"
            )
        S = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        max_q = 0
        for toks, start, table in chunks:
            n = len(toks)
            end = start + n
            ids.extend(toks)
            if n == 1:  # decode: no per-token range objects
                positions.append(start)
                slots.append(table[start // S] * S + start % S)
            else:
                positions.extend(range(start, end))
                slots.extend(table[p // S] * S + p % S for p in range(start, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            tables.append(table)
            max_q = max(max_q, n)
        t, b = len(ids), len(seq_lens)
        m = max(len(x) for x in tables)
        if max_q == 1 and t == b and self.graphs and b <= self.buckets[-1] and m <= self.max_blocks:
            hidden = self._replay(ids, positions, slots, seq_lens, tables, feed, state)
        else:
            hidden = self._eager_forward(
                ids, positions, slots, qsl, seq_lens, tables, max_q, m, feed, state
            )
        return hidden, qsl, seq_lens

    def _eager_forward(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        qsl: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        max_query_len: int,
        m: int,
        feed: tuple[list[int], list[int], torch.Tensor] | None = None,
        state: StepState | None = None,
    ) -> torch.Tensor:
        t, b = len(ids), len(seq_lens)
        k = len(feed[0]) if feed is not None else 0
        self.num_eager += 1
        # Triton specializes each pointer on 16-byte alignment and each int on "divisible by
        # 16": unaligned segments and an odd table width made every new (T, B, M) combination
        # a new compile in the middle of serving (H200: 14 compiles, ~9 s, in the first
        # 1000-prompt run). Aligned segments and a table width padded to 16 fix both.
        mw = _pad16(m)
        o_ids, o_pos, o_slot, o_qsl, o_sl, o_tab, o_fd, o_fr, need = _eager_layout(t, b, mw, k)
        buf = self._eager if need <= self._eager.host.numel() else _Packed(need, self.device)
        h = buf.host_view()
        h[o_ids : o_ids + t] = ids
        h[o_pos : o_pos + t] = positions
        h[o_slot : o_slot + t] = slots
        h[o_qsl : o_qsl + b + 1] = qsl
        h[o_sl : o_sl + b] = seq_lens
        _fill_table(h[o_tab : o_tab + b * mw].reshape(b, mw), tables)
        if k:
            h[o_fd : o_fd + k] = feed[0]
            h[o_fr : o_fr + k] = feed[1]
        dev = buf.upload(need)
        if k:
            feed_tokens(dev[o_ids : o_ids + t], dev[o_fd : o_fd + k], dev[o_fr : o_fr + k], feed[2])
        md = self.attn_backend.build_metadata(
            query_start_loc=dev[o_qsl : o_qsl + b + 1],
            seq_lens=dev[o_sl : o_sl + b],
            block_tables=dev[o_tab : o_tab + b * mw].view(b, mw),
            slot_mapping=dev[o_slot : o_slot + t],
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            query_start_loc_host=qsl,
            seq_lens_host=seq_lens,
        )
        if state is not None:  # host lists: the state layers build their tensors (mamba.py)
            md.derived["state_slots"], md.derived["state_fresh"] = state
        return self.model(dev[o_ids : o_ids + t], dev[o_pos : o_pos + t], self.kv_caches, md)

    @torch.inference_mode()
    def warmup(self, batch_sizes: tuple[int, ...] = (1, 2, 16)) -> None:
        """Compile the Triton specialisations of eager (prefill / mixed) steps at start-up rather
        than during the first requests: one dummy step of 2-token chunks per batch size, which
        covers the kernels' "num_seqs == 1 / divisible by 16 / other" cases. Slots are -1, so
        nothing is written to the KV cache; a state model's rows all use the scratch slot."""
        for b in batch_sizes:
            if b > self.max_num_seqs:
                continue
            n = 2 * b
            scratch = self.state_scratch
            state = ([scratch] * b, [True] * b) if scratch is not None else None
            self._eager_forward(
                [0] * n, [0, 1] * b, [-1] * n, list(range(0, n + 1, 2)), [2] * b,
                [[0]] * b, 2, 1, None, state,
            )  # fmt: skip
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- decode CUDA graphs ----------------------------------------------------------------

    def _setup_graph_buffers(self) -> None:
        bmax, m = self.buckets[-1], self.max_blocks
        # Layout: ids [Bmax] | positions [Bmax] | slots [Bmax] | seq_lens [Bmax] | feed indices
        # [Bmax] | feed rows [Bmax] | (state models: state slots [Bmax] | keep flags [Bmax]) |
        # table [Bmax, M]; query_start_loc is arange (one token per request), constant, apart.
        self._tab = (6 if self.state_scratch is None else 8) * bmax  # the table's offset
        self._g = _Packed(self._tab + bmax * m, self.device)
        d = self._g.dev
        self.g_ids = d[0:bmax]
        self.g_pos = d[bmax : 2 * bmax]
        self.g_slots = d[2 * bmax : 3 * bmax]
        self.g_seq_lens = d[3 * bmax : 4 * bmax]
        self.g_state_slots = d[6 * bmax : 7 * bmax]  # (empty views without state)
        self.g_state_keep = d[7 * bmax : self._tab]
        self.g_table = d[self._tab :].view(bmax, m)
        self.g_qsl = torch.arange(bmax + 1, dtype=torch.int32, device=self.device)

    def _graph_md(self, b: int, splits: int) -> AttentionMetadata:
        """The metadata bucket b's graph is captured with: views of the static buffers, the
        backend's launch knobs fixed (its graph-capture hook)."""
        md = self.attn_backend.build_metadata(
            query_start_loc=self.g_qsl[: b + 1],
            seq_lens=self.g_seq_lens[:b],
            block_tables=self.g_table[:b],
            slot_mapping=self.g_slots[:b],
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
            query_start_loc_host=list(range(b + 1)),
            seq_lens_host=[1] * b,
        )
        md = self.attn_backend.graph_metadata(md, splits)
        if self.state_scratch is not None:
            # Host lists: on a decode step the state layers read only their length (B); the
            # values they use are the static buffers' (`_graph_forward`).
            md.derived["state_slots"] = [self.state_scratch] * b
            md.derived["state_fresh"] = [True] * b
        return md

    def _graph_forward(self, b: int, md: AttentionMetadata) -> torch.Tensor:
        """Bucket b's forward over the static buffers: what its graph captures. A state model's
        slot and keep tensors are made here, from the static int32 buffers, so that they are
        part of the graph and recomputed at every replay (int64 slots and float32 keep flags,
        as `models/mamba._step_state` makes them on eager steps)."""
        if self.state_scratch is not None:
            md.derived["state_tensors"] = (
                self.g_state_slots[:b].long(),
                self.g_state_keep[:b].float(),
            )
        return self.model(self.g_ids[:b], self.g_pos[:b], self.kv_caches, md)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first so smaller ones reuse its memory pool."""
        if not self.buckets:
            return
        t0 = time.perf_counter()
        bmax = self.buckets[-1]
        # Dummy decode inputs: token 0 at position 0, seq_len 1, block 0, no KV write; state
        # models: every row on the scratch slot, keep 0 (the warm-up runs write it).
        self._g.host_np[:] = 0
        self._g.host_np[3 * bmax : 4 * bmax] = 1
        self._g.host_np[2 * bmax : 3 * bmax] = -1
        if self.state_scratch is not None:
            self._g.host_np[6 * bmax : 7 * bmax] = self.state_scratch
        self._g.upload(self._g.host.numel())
        if self.device.type != "cuda":  # CPU (tests): each bucket's forward runs at replay
            for b in reversed(self.buckets):
                splits = graph_kv_splits(b, self.num_kv_heads, self.group, _CPU_SMS,
                                         self.max_kv_splits)  # fmt: skip
                md = self._graph_md(b, splits)
                g = _EagerReplay(lambda b=b, md=md: self._graph_forward(b, md))
                self.graphs[b] = (g, g.out, splits)
            return
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                splits = graph_kv_splits(b, self.num_kv_heads, self.group, sms, self.max_kv_splits)
                md = self._graph_md(b, splits)
                for _ in range(2):  # warm up: Triton compiles, allocator settles
                    self._graph_forward(b, md)
                stream.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    out = self._graph_forward(b, md)
                self.graphs[b] = (g, out, splits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info(
            "captured %d decode CUDA graphs (batch %s) in %.1f s",
            len(self.graphs),
            self.buckets,
            self.capture_seconds,
        )

    def _replay(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        feed: tuple[list[int], list[int], torch.Tensor] | None = None,
        state: StepState | None = None,
    ) -> torch.Tensor:
        n = len(ids)
        b = next(x for x in self.buckets if x >= n)
        bmax, m, tab = self.buckets[-1], self.max_blocks, self._tab
        h = self._g.host_view()
        h[0:n] = ids
        h[n:b] = 0
        h[bmax : bmax + n] = positions
        h[bmax + n : bmax + b] = 0
        h[2 * bmax : 2 * bmax + n] = slots
        h[2 * bmax + n : 2 * bmax + b] = -1
        h[3 * bmax : 3 * bmax + n] = seq_lens
        h[3 * bmax + n : 3 * bmax + b] = 1
        k = len(feed[0]) if feed is not None else 0
        if k:
            h[4 * bmax : 4 * bmax + k] = feed[0]
            h[5 * bmax : 5 * bmax + k] = feed[1]
        if state is not None:
            fill_state_rows(h[6 * bmax : 7 * bmax], h[7 * bmax : tab], state, b, self.state_scratch)
        table = h[tab : tab + b * m].reshape(b, m)
        _fill_table(table, tables)
        # Only the first tab + b * m ints are read by this bucket's graph.
        d = self._g.upload(tab + b * m)
        if k:
            feed_tokens(self.g_ids, d[4 * bmax : 4 * bmax + k], d[5 * bmax : 5 * bmax + k], feed[2])
        g, out, _ = self.graphs[b]
        g.replay()
        self.num_replays += 1
        self.bucket_replays[b] = self.bucket_replays.get(b, 0) + 1
        return out[:n]


def feed_tokens(
    ids: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor
) -> None:
    """ids[index] = tokens[rows] on the device, stream-ordered after the upload (no host sync:
    gather + scatter_, not advanced-index assignment)."""
    rows, index = rows.long(), index.long()
    ids.scatter_(0, index, tokens.gather(0, rows).to(ids.dtype))


def fill_state_rows(
    slots_dst: np.ndarray, keep_dst: np.ndarray, state: StepState, b: int, scratch: int
) -> None:
    """A decode bucket's state rows: slots_dst / keep_dst [>= b] <- the n requests' slots and
    keep flags (1 = carry the state, 0 = fresh), then b - n padding rows on the scratch slot
    with keep 0 (they never touch a request's state)."""
    slots, fresh = state
    n = len(slots)
    if n > b or len(fresh) != n:
        raise ValueError(f"{n} state rows ({len(fresh)} fresh flags) for a bucket of {b}")
    slots_dst[:n] = slots
    slots_dst[n:b] = scratch
    keep_dst[:n] = [0 if f else 1 for f in fresh]
    keep_dst[n:b] = 0


def _pad16(n: int) -> int:
    """n rounded up to a multiple of 16 (ints: 64 bytes)."""
    return -(-n // 16) * 16


def _eager_layout(t: int, b: int, mw: int, k: int) -> tuple[int, ...]:
    """Offsets (in int32s) of the eager upload's segments, each 16-int aligned: ids, positions,
    slots [T], query_start_loc [B+1], seq_lens [B], block table [B, mw], feed indices and rows
    [k]; the last value is the total length."""
    sizes = (t, t, t, b + 1, b, b * mw, k, k)
    offs, o = [], 0
    for n in sizes:
        offs.append(o)
        o += _pad16(n)
    return (*offs, o)


def _fill_table(dst: np.ndarray, tables: list[list[int]]) -> None:
    """Rows of dst [B', M] <- block id lists (zero padded); rows past len(tables) zeroed."""
    dst[:] = 0
    for i, t in enumerate(tables):
        dst[i, : len(t)] = t


def make_cuda_step_runner(runner: object) -> CudaStepRunner:
    """Build (and, unless config.enforce_eager, capture graphs for) a TorchModelRunner's GPU steps.
    Called once the runner's model and KV cache exist: graphs bind the cache's addresses."""
    cfg, spec = runner.config, runner.spec
    step = CudaStepRunner(
        runner.model,
        runner.kv_caches,
        hidden_size=spec.hidden_size,
        dtype=runner.dtype,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        num_kv_heads=spec.num_kv_heads,
        num_heads=spec.num_heads,
        use_graphs=not cfg.enforce_eager,
        attn_backend=runner.attn_backend,
        max_kv_splits=cfg.kernels.graph_max_kv_splits,
        device=runner.device,
        state_scratch_slot=runner.state_scratch_slot() if runner.state_model else None,
    )
    step.capture()
    step.warmup()
    return step
