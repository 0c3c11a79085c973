"""TorchModelRunner: the Torch backend's ModelRunner (CPU path; the GPU path builds on it).

Keeps per-request state (a persistent batch) keyed by request id, builds the flat ragged batch of
each step (input ids, positions, slot mapping, attention metadata), runs the model, and samples
for requests whose scheduled chunk reaches the end of their known tokens.

Speculative decoding: a request with d drafts in `spec_token_ids` has its last 1 + d positions
scored and verified by `Sampler.verify` (greedy / lossless rejection sampling); the runner keeps
only the accepted drafts + 1 token. With `method="draft_model"` a second, small model runs here
with its own paged KV cache indexed by the SAME block tables (same num_blocks, plus a few scratch
blocks per batch slot for proposal positions past the request's allocated blocks). Each step it
catches up on the step's verified tokens (writing its KV where the target wrote its own) and then
proposes K tokens greedily (deterministic drafts: q is one-hot in the rejection sampler).
With `method="eagle"` an EAGLE head (backends_torch/eagle.py) drafts from the target's features
the same way (its one-layer KV cache in `draft_kv_caches`).

Async scheduling (xlaserve.runner, `launch` / `finish`): `launch` issues a step's GPU work and
returns without waiting when every sampling request takes the greedy fast path; its tokens are
appended as placeholders (PENDING) and copied to pinned host memory in the background. A request
scheduled again before `finish` has a PENDING last token: its input id is fed on the device from
the previous launch's argmax tensor, so the GPU never waits for the host.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from xlaserve.backends_torch.distributed.parallel_state import kv_heads_per_rank, tp_world_size
from xlaserve.backends_torch.layers.attention import (
    AttentionMetadata,
    check_kv_cache_dtype,
    get_attention_backend,
)
from xlaserve.backends_torch.models import get_model_class
from xlaserve.backends_torch.sampler import (
    PinnedRing,
    Sampler,
    SamplingRow,
    argmax_only_step,
    deferrable_step,
    is_plain_greedy,
    to_device,
    token_logprobs,
)
from xlaserve.config import EngineConfig, KernelConfig
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.platforms import current_platform
from xlaserve.runner import RunnerOutput, SchedulerOutput, TokenLogprobs
from xlaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(requested: str, checkpoint_dtype: str, device: str) -> torch.dtype:
    """ "auto" -> the checkpoint dtype, except float16 on CPU -> float32 (slow/unsupported there)."""
    name = checkpoint_dtype.replace("torch.", "") if requested == "auto" else requested
    dtype = _DTYPES.get(name, torch.float32)
    if device == "cpu" and dtype == torch.float16:
        dtype = torch.float32
    return dtype


def nonfinite_rows(logits: torch.Tensor | None, suspect: list[int] | list[bool]) -> set[int]:
    """Rows of logits [R, V] holding NaN or +-inf. `suspect[r]`: row r's sum is not finite
    (a row with NaN/inf always has a non-finite sum; only suspects are checked element-wise,
    since finite values can overflow a float32 sum). logits None: `suspect` is already exact
    (the fused greedy kernel's element-wise flags), nothing to re-check."""
    cand = [r for r, x in enumerate(suspect) if x]
    if not cand or logits is None:
        return set(cand)
    idx = torch.tensor(cand, device=logits.device)
    ok = torch.isfinite(logits[idx]).all(dim=-1).tolist()
    return {r for r, f in zip(cand, ok, strict=True) if not f}


@dataclass
class _ReqState:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    # Prompt logprobs are emitted only on a request's first life (not again after preemption).
    emit_prompt_logprobs: bool = False
    extra: dict = field(default_factory=dict)
    # Per-request constants of the sampling fast path (set from params at creation).
    plain_greedy: bool = False  # sampler.is_plain_greedy(params)
    # Row of the last launch's argmax tensor holding this request's PENDING token.
    pending_row: int = -1

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


# Placeholder token id: sampled by a launched step whose tokens have not reached the host yet.
PENDING = -1
NONFINITE_ERROR = "non-finite logits (NaN or inf) produced by the model for this request"
ENV_FUSED_GREEDY = KernelConfig.env_name("fused_greedy")


@dataclass
class _Launched:
    """A launched step (`TorchModelRunner.launch`): its output so far, and for a greedy fast-path
    step the device tensors whose values `finish` still has to read."""

    out: RunnerOutput
    # (request id, its state, index of its PENDING token, logits row): fast-path samples.
    pending: list[tuple[str, _ReqState, int, int]] = field(default_factory=list)
    host: torch.Tensor | None = None  # pinned [2R]: argmax tokens, then non-finite flags
    ready: torch.cuda.Event | None = None
    # [R, V], kept for the exact non-finite re-check; None when the flags are exact (fused greedy).
    logits: torch.Tensor | None = None
    num_rows: int = 0


class TorchModelRunner:
    """Implements `xlaserve.runner.ModelRunner` with Torch models. Constructed as cls(config, spec)."""

    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        self.config = config
        self.spec = spec
        self.device = torch.device(current_platform.torch_device())
        self.dtype = resolve_dtype(config.model.dtype, spec.checkpoint_dtype, self.device.type)
        # Weight quantization (None = float); raises early for unsupported fp8.
        from xlaserve.backends_torch.layers.linear import torch_quant_scheme

        self.quant_scheme = torch_quant_scheme(config, spec, self.device)
        self.block_size = config.cache.block_size
        # CUDA: Triton paged attention (graph-capturable); elsewhere one batched torch attention.
        self.kernels = config.kernels
        default_attn = "triton" if self.device.type == "cuda" else "torch_batched"
        ab = self.kernels.attention_backend
        self.attn_backend_name = default_attn if ab == "auto" else ab
        self.attn_backend = get_attention_backend(self.attn_backend_name, self.kernels)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.requests: dict[str, _ReqState] = {}
        self.sampler = Sampler(self.device, seed=config.model.seed)
        # CUDA step executor (one packed metadata upload, decode CUDA graphs); see init_kv_cache.
        self.cuda_step = None
        # The last deferred launch's argmax tokens [R] (feeds PENDING inputs of the next launch).
        self._last_argmax: torch.Tensor | None = None
        self.num_deferred_steps = 0  # steps whose tokens were left on the device by launch
        # Greedy fast path through the fused argmax kernel (kernels_cuda.sampling: one pass over
        # the lm_head output, no float32 copy, exact non-finite flags). By default on CUDA only:
        # on the CPU the Triton interpreter is far too slow to serve. KernelConfig.fused_greedy
        # "off" turns it off, "on" on anywhere (CPU tensors need TRITON_INTERPRET=1: tests).
        fg = self.kernels.fused_greedy
        self.fused_greedy = fg == "on" or (fg == "auto" and self.device.type == "cuda")
        self._token_ring: PinnedRing | None = None  # pinned host slots for deferred tokens
        # KV offload copy engine (host/disk tiers), made by init_kv_cache when configured.
        self.kv_offload = None
        self.max_model_len = config.model.max_model_len or spec.max_position_embeddings
        # Draft model (speculative method "draft_model"): its spec, module and KV cache.
        sc = config.speculative
        self.num_spec_tokens = sc.num_speculative_tokens if sc is not None else 0
        self.draft_spec: ModelSpec | None = None
        self.draft_model: torch.nn.Module | None = None
        self.draft_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # EAGLE head (speculative method "eagle"): backends_torch/eagle.py; checks the head here.
        self.eagle = None
        if sc is not None and sc.method == "eagle":
            from xlaserve.backends_torch.eagle import EagleProposer

            self.eagle = EagleProposer(self, sc.model)
        if sc is not None and sc.method == "draft_model":
            from xlaserve.model_loader.registry import build_spec
            from xlaserve.model_loader.resolve import resolve_model_dir

            self.draft_spec = build_spec(
                resolve_model_dir(sc.model, None, config.load.download_dir)
            )
            if self.draft_spec.vocab_size > spec.vocab_size:
                raise ValueError(
                    f"draft model vocab ({self.draft_spec.vocab_size}) is larger than the target's "
                    f"({spec.vocab_size}): the draft must share the target's tokenizer"
                )
        # Scratch blocks per batch slot in the draft cache (proposal positions past the
        # request's allocated blocks): K positions at most.
        self._draft_scratch = -(-self.num_spec_tokens // self.block_size) + 1
        self._draft_slots = config.scheduler.max_num_seqs
        # Quantized KV cache ("int8"/"fp8": per layer (k codes, v codes, k scales, v scales));
        # kv_code_dtype None = (k, v) in the model dtype. The draft's cache follows the same dtype.
        self.kv_cache_dtype = config.cache.kv_cache_dtype
        self.kv_code_dtype = check_kv_cache_dtype(
            self.kv_cache_dtype, self.attn_backend_name, self.device, self.attn_backend
        )

    # ---- setup ----------------------------------------------------------------------------

    def load_model(self) -> None:
        cls = get_model_class(self.spec.family)
        torch.manual_seed(self.config.model.seed)
        model = cls(
            self.spec, dtype=self.dtype, device=self.device, attn_backend=self.attn_backend,
            kernels=self.kernels,
        )  # fmt: skip
        qs = self.quant_scheme
        if self.config.load.load_format == "dummy":
            model.init_dummy_weights(seed=self.config.model.seed)
            if qs is not None:
                from xlaserve.backends_torch.layers.linear import quantize_linears

                quantize_linears(model, qs, from_weights=True)
        else:
            from xlaserve.model_loader.registry import iter_canonical_weights

            weights = iter_canonical_weights(self.spec, self.config.load.load_format)
            if tp_world_size() > 1:  # cut each full tensor to this rank's shard
                from xlaserve.backends_torch.distributed.layers import tp_weight_stream

                weights = tp_weight_stream(model, weights)
            if qs is not None:  # swap in QuantLinears; quantize float weights while loading
                from xlaserve.backends_torch.layers import linear as ql

                ql.quantize_linears(model, qs)
                weights = ql.quantized_weight_stream(model, qs, weights)
            model.load_weights(weights)
        model.use_kernels(self.kernels)  # again: quantization swapped layers in
        self.model = model.eval()
        if self.draft_spec is not None:
            dcls = get_model_class(self.draft_spec.family)
            draft = dcls(
                self.draft_spec,
                dtype=self.dtype,
                device=self.device,
                attn_backend=self.attn_backend,
                kernels=self.kernels,
            )
            if self.config.load.load_format == "dummy":
                draft.init_dummy_weights(seed=self.config.model.seed + 1)
            else:
                from xlaserve.model_loader.registry import iter_canonical_weights

                dw = iter_canonical_weights(self.draft_spec, self.config.load.load_format)
                if tp_world_size() > 1:
                    from xlaserve.backends_torch.distributed.layers import tp_weight_stream

                    dw = tp_weight_stream(draft, dw)
                draft.load_weights(dw)
            self.draft_model = draft.eval()
        if self.eagle is not None:
            self.eagle.load()

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block id: the target's KV plus, with a draft model, the draft's KV."""
        elem = torch.empty((), dtype=self.dtype).element_size()

        def rank_bytes(spec: ModelSpec) -> int:  # this rank's KV heads only (tensor parallel)
            h = spec.num_kv_heads
            return spec.kv_bytes_per_token(elem, self.kv_cache_dtype) * kv_heads_per_rank(h) // h

        per_token = rank_bytes(self.spec)
        if self.draft_spec is not None:
            per_token += rank_bytes(self.draft_spec)
        extra = 0 if self.eagle is None else self.eagle.bytes_per_block(rank_bytes(self.eagle.spec))
        return self.block_size * per_token + extra

    def determine_num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type != "cuda":
            n = cache.cpu_kv_cache_bytes // per_block
        else:
            n = self._profile_cuda_blocks(per_block)
        if n <= 0:
            raise RuntimeError(
                f"no memory left for the KV cache ({per_block} bytes per block): lower max_num_batched_tokens, "
                "raise gpu_memory_utilization / cpu_kv_cache_bytes, or use a smaller model"
            )
        return int(n)

    def _profile_cuda_blocks(self, per_block: int) -> int:
        """Blocks that fit in total * gpu_memory_utilization after weights and a peak forward."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        tokens = min(
            self.config.scheduler.max_num_batched_tokens, self.spec.max_position_embeddings
        )
        nblk = math.ceil(tokens / self.block_size)
        caches = self._alloc_caches(nblk)
        self._dummy_forward(tokens, caches)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - sum(
            t.numel() * t.element_size() for layer in caches for t in layer
        )
        del caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        others = total - free - torch.cuda.memory_reserved()  # other processes / CUDA context
        budget = total * self.config.cache.gpu_memory_utilization - others - peak
        if budget < per_block:
            gib = 1 << 30
            raise RuntimeError(
                f"the model does not fit: weights + a peak forward of {tokens} tokens take "
                f"{peak / gib:.2f} GiB, other users/context {others / gib:.2f} GiB, of "
                f"{total / gib:.2f} GiB x gpu_memory_utilization "
                f"{self.config.cache.gpu_memory_utilization}; nothing is left for the KV cache "
                f"({per_block} bytes per block). Raise gpu_memory_utilization, lower "
                "max_num_batched_tokens, or use a smaller model / dtype."
            )
        return int(budget // per_block)

    def _dummy_forward(self, tokens: int, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(tokens, device=self.device)
        nblk = caches[0][0].shape[0]
        md = self.attn_backend.build_metadata(
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(nblk, dtype=torch.int32, device=self.device)[None, :],
            slot_mapping=pos.clone(),
            max_query_len=tokens,
            max_seq_len=tokens,
            query_start_loc_host=[0, tokens],
            seq_lens_host=[tokens],
        )
        hidden = self.model(ids, pos, caches, md)
        # Sampling holds logits of up to max_num_seqs rows [B, V] float32 at once.
        self.model.compute_logits(hidden[-min(tokens, self.config.scheduler.max_num_seqs) :])

    def _alloc_caches(
        self, num_blocks: int, spec: ModelSpec | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        spec = spec or self.spec
        # Hkv of this rank: tensor parallelism splits the KV heads.
        shape = (num_blocks, self.block_size, kv_heads_per_rank(spec.num_kv_heads), spec.head_dim)
        if self.kv_code_dtype is not None:  # codes + float32 scales [N, S, Hkv]
            return [
                (
                    torch.zeros(shape, dtype=self.kv_code_dtype, device=self.device),
                    torch.zeros(shape, dtype=self.kv_code_dtype, device=self.device),
                    torch.ones(shape[:3], dtype=torch.float32, device=self.device),
                    torch.ones(shape[:3], dtype=torch.float32, device=self.device),
                )
                for _ in range(spec.num_layers)
            ]
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(spec.num_layers)
        ]

    def init_kv_cache(self, num_blocks: int) -> None:
        """Per layer K and V tensors [N, S, Hkv, D] (the draft's: N + scratch blocks); quantized
        (kv_cache_dtype int8/fp8): (K codes, V codes, K scales, V scales [N, S, Hkv] float32)."""
        self.num_blocks = num_blocks
        self.kv_caches = self._alloc_caches(num_blocks)
        if self.draft_spec is not None:
            scratch = self._draft_scratch * self._draft_slots
            self.draft_kv_caches = self._alloc_caches(num_blocks + scratch, self.draft_spec)
        if self.eagle is not None:  # the head's KV goes into draft_kv_caches (offload carries it)
            self.eagle.init_cache(num_blocks)
        from xlaserve.backends_torch.kv_offload import make_torch_kv_offload

        self.kv_offload = make_torch_kv_offload(self)
        if self.device.type == "cuda" and self.attn_backend.cuda_graphs:
            from xlaserve.backends_torch.cuda_graphs import make_cuda_step_runner

            self.cuda_step = make_cuda_step_runner(self)
        self._warm_fused_greedy()

    def _warm_fused_greedy(self) -> None:
        """Compile the fused greedy kernel's variants at start-up, not in the first steps: the
        row counts 1 (most chunks) and max_num_seqs (fewest) cover every step's chunking."""
        if not (self.fused_greedy and self.device.type == "cuda"):
            return
        for rows in (1, self.config.scheduler.max_num_seqs):
            h = torch.zeros((rows, self.spec.hidden_size), dtype=self.dtype, device=self.device)
            self._fused_greedy(h)
        torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        self.cuda_step = None  # its CUDA graphs hold the KV cache and their memory pool
        self.kv_caches = []
        self.draft_kv_caches = []
        self.draft_model = None
        self.eagle = None
        self.model = None
        self.requests.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- step -----------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for nr in so.new_requests:
            p = nr.sampling_params
            self.requests[nr.req_id] = _ReqState(
                token_ids=list(nr.token_ids),
                num_prompt_tokens=nr.num_prompt_tokens,
                params=p,
                block_ids=list(nr.block_ids),
                num_computed_tokens=nr.num_computed_tokens,
                generator=self.sampler.make_generator(p.seed) if p.seed is not None else None,
                emit_prompt_logprobs=p.prompt_logprobs is not None
                and len(nr.token_ids) == nr.num_prompt_tokens,
                plain_greedy=is_plain_greedy(p),
            )
        for cr in so.cached_requests:
            st = self.requests.get(cr.req_id)
            if st is None:
                raise KeyError(
                    f"cached request {cr.req_id!r} is unknown to the runner (never sent as new)"
                )
            st.block_ids.extend(cr.new_block_ids)
            if cr.num_computed_tokens != st.num_computed_tokens:
                # The scheduler is the source of truth (e.g. after rejected drafts).
                logger.debug(
                    "req %s: num_computed %d -> %d",
                    cr.req_id,
                    st.num_computed_tokens,
                    cr.num_computed_tokens,
                )
                st.num_computed_tokens = cr.num_computed_tokens

    def _build_inputs(
        self, chunks: list[tuple[list[int], int, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """chunks: per request (token ids to compute, position of the first, block table).
        Returns input ids [T], positions [T] and the attention metadata of the ragged batch."""
        # Vectorised with numpy (no per-token Python work): one flat copy of the token ids and
        # of the block tables, positions and slots by index arithmetic.
        S, dev = self.block_size, self.device
        b = len(chunks)
        lens = np.fromiter((len(c[0]) for c in chunks), np.int64, b)
        starts = np.fromiter((c[1] for c in chunks), np.int64, b)
        nblk = np.fromiter((len(c[2]) for c in chunks), np.int64, b)
        t = int(lens.sum())
        ids = np.fromiter(itertools.chain.from_iterable(c[0] for c in chunks), np.int64, t)
        flat_tables = itertools.chain.from_iterable(c[2] for c in chunks)
        table = np.zeros((b, int(nblk.max())), np.int32)
        table[np.arange(table.shape[1]) < nblk[:, None]] = np.fromiter(
            flat_tables, np.int32, int(nblk.sum())
        )  # row-major boolean fill: row i gets its own table, zero-padded
        qsl = np.zeros(b + 1, np.int64)
        np.cumsum(lens, out=qsl[1:])
        seq_lens = starts + lens
        if t == b:  # one token per request (decode)
            row, positions = np.arange(b), starts
        else:
            row = np.repeat(np.arange(b), lens)
            positions = np.arange(t) - np.repeat(qsl[:-1] - starts, lens)
        slots = table[row, positions // S].astype(np.int64) * S + positions % S
        qsl_host, seq_lens_host = qsl.tolist(), seq_lens.tolist()
        md = self.attn_backend.build_metadata(
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(table).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(lens.max()),
            max_seq_len=max(seq_lens_host),
            query_start_loc_host=qsl_host,
            seq_lens_host=seq_lens_host,
        )
        input_ids = torch.from_numpy(ids).to(dev)
        pos_t = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(dev)
        return input_ids, pos_t, md

    @property
    def async_by_default(self) -> bool:
        """async_scheduling="auto": on for CUDA (H200, 8B shape, offline 256/256: 12,359 and
        13,565 vs 11,207 tok/s synchronous, batch 1 214.6 vs 203.4; bench/RESULTS.md), off on
        the CPU, where torch ops run to completion before returning (1.01x / 0.98x)."""
        return self.device.type == "cuda"

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self._launch(scheduler_output, defer=False).out

    def launch(self, scheduler_output: SchedulerOutput) -> _Launched:
        """Issue one step; greedy fast-path tokens are read by `finish` (xlaserve.runner)."""
        return self._launch(scheduler_output, defer=True)

    def finish(self, launched: _Launched) -> RunnerOutput:
        """Wait for a launched step's tokens; fill its PENDING placeholders."""
        h, out = launched, launched.out
        if not h.pending:
            return out
        if h.ready is not None:
            h.ready.synchronize()
        host = h.host.tolist()
        r = h.num_rows
        bad = nonfinite_rows(h.logits, host[r:])
        for rid, st, idx, row in h.pending:
            if row in bad:
                out.errors[rid] = NONFINITE_ERROR
                continue
            tok = host[row]
            if self.requests.get(rid) is st:  # else finished/preempted since: nothing to fill
                st.token_ids[idx] = tok
            out.sampled_token_ids[rid] = [tok]
        h.pending, h.logits = [], None
        return out

    def _launch(self, scheduler_output: SchedulerOutput, defer: bool) -> _Launched:
        so = scheduler_output
        if so.has_kv_copies:  # before the forward, in the order runner.py documents
            if self.kv_offload is None:
                raise RuntimeError("KV offload copies scheduled but kv_offload_bytes is 0")
            self.kv_offload.apply(so.kv_disk_out, so.kv_copy_out, so.kv_disk_in, so.kv_copy_in)
        stray = [r for r, d in so.spec_token_ids.items() if d and r not in so.num_scheduled_tokens]
        if stray:
            raise ValueError(f"speculative drafts for requests not scheduled this step: {stray}")
        self._update_states(so)
        out = RunnerOutput()
        launched = _Launched(out)
        if not so.num_scheduled_tokens:
            return launched
        assert self.model is not None, "load_model() must run before execute()"

        S = self.block_size
        order = list(so.num_scheduled_tokens.items())
        chunks: list[tuple[list[int], int, list[int]]] = []
        drafts: list[list[int]] = []
        starts: list[int] = []
        states: list[_ReqState] = []  # per batch entry (one dict lookup per request and step)
        spec = so.spec_token_ids
        prompt_lp = False
        # Inputs still on the device (async scheduling): (flat index in the batch, row of the
        # previous launch's argmax tensor) for each request whose last token is PENDING.
        feed_dst: list[int] = []
        feed_src: list[int] = []
        t_off = 0
        for rid, n in order:
            st = self.requests[rid]
            states.append(st)
            prompt_lp = prompt_lp or st.emit_prompt_logprobs
            ds = list(spec[rid]) if rid in spec else []
            known = st.token_ids + ds if ds else st.token_ids
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            if known[end - 1] == PENDING:
                feed_dst.append(t_off + n - 1)
                feed_src.append(st.pending_row)
            t_off += n
            if end > len(known):
                raise ValueError(
                    f"req {rid}: scheduled up to token {end} but only {len(known)} tokens are known"
                )
            if ds and end != len(known):
                raise ValueError(
                    f"req {rid}: {len(ds)} drafts scheduled but the chunk ends at {end}"
                )
            if -(-end // S) > len(st.block_ids):
                raise ValueError(
                    f"req {rid}: {end} tokens need {math.ceil(end / S)} blocks, has {len(st.block_ids)}"
                )
            chunks.append((known[start:end], start, st.block_ids))
            drafts.append(ds)
            starts.append(start)
        feed = (feed_dst, feed_src, self._last_argmax) if feed_dst else None
        if self.cuda_step is not None:  # one H2D upload; decode steps replay a CUDA graph
            hidden, qsl, seq_lens = self.cuda_step.forward(chunks, feed)
        else:
            input_ids, pos_t, md = self._build_inputs(chunks)
            if feed is not None:
                from xlaserve.backends_torch.cuda_graphs import feed_tokens

                dev = self.device
                feed_tokens(input_ids, to_device(feed_dst, torch.long, dev),
                            to_device(feed_src, torch.long, dev), self._last_argmax)  # fmt: skip
            qsl, seq_lens = md.query_start_loc_host, md.seq_lens_host
            hidden = self.model(input_ids, pos_t, self.kv_caches, md)  # [T, H]

        # Prompt logprobs for the chunk's prompt positions (before num_computed is advanced).
        for b, st in enumerate(states) if prompt_lp else ():
            if st.emit_prompt_logprobs:
                entries = self._prompt_logprobs(
                    st, hidden[qsl[b] : qsl[b + 1]], st.num_computed_tokens
                )
                if entries:
                    out.prompt_logprobs[order[b][0]] = entries

        # Requests whose chunk reaches the end of their known tokens (+ drafts) sample.
        sample_b = [
            b for b, st in enumerate(states) if seq_lens[b] == len(st.token_ids) + len(drafts[b])
        ]
        for b, (rid, n) in enumerate(order):
            states[b].num_computed_tokens = starts[b] + n
            out.sampled_token_ids[rid] = []
        sampled_ok: set[str] = set()
        # Deferred tokens only without in-runner drafting (it reads this step's tokens at once).
        defer = defer and self.draft_model is None and self.eagle is None
        if sample_b:
            self._sample(so, order, sample_b, drafts, hidden, qsl, out, sampled_ok, launched, defer)
        if launched.pending:
            return launched
        if self.draft_model is not None:
            out.spec_token_ids = self._propose(order, starts, seq_lens, sampled_ok)
        elif self.eagle is not None:
            out.spec_token_ids = self.eagle.propose(
                order, starts, seq_lens, hidden, qsl, sampled_ok, out.errors
            )
        return launched

    def _sample(
        self,
        so: SchedulerOutput,
        order: list[tuple[str, int]],
        sample_b: list[int],
        drafts: list[list[int]],
        hidden: torch.Tensor,
        qsl: list[int],
        out: RunnerOutput,
        sampled_ok: set[str],
        launched: _Launched,
        defer: bool,
    ) -> None:
        """Score the last 1 + d rows of each sampling request, sample / verify, append tokens.
        defer: a fast-path step appends PENDING tokens and leaves the reading to `finish`."""
        dev = self.device
        row_idx: list[int] = []
        spans: list[tuple[int, int]] = []  # (first logits row, 1 + d) per sampling request
        for b in sample_b:
            d = len(drafts[b])
            spans.append((len(row_idx), 1 + d))
            row_idx.extend(range(qsl[b + 1] - 1 - d, qsl[b + 1]))
        r_total = len(row_idx)
        # A pure decode step samples every row of `hidden`: no gather copy.
        # A pageable torch.tensor(..., device=cuda) copy would wait for the queued forward (a
        # prefill step's whole compute), stalling async scheduling: pinned, non-blocking upload.
        h = hidden if r_total == hidden.shape[0] else hidden[to_device(row_idx, torch.long, dev)]
        # Fast path: only plain greedy requests (sampler.is_plain_greedy; no drafts, bitmask or
        # active min_tokens masking): tokens are the argmax of the raw logits, no SamplingRows.
        # Deferred (async scheduling): every row samples on the device without host data.
        fast = deferrable = True
        for b in sample_b:
            rid = order[b][0]
            st = self.requests[rid]
            n_out = len(st.token_ids) - st.num_prompt_tokens
            has_mask = rid in so.grammar_bitmask
            if drafts[b]:
                fast = deferrable = False
                break
            if fast and not argmax_only_step(st.params, st.plain_greedy, n_out, has_mask):
                fast = False
            if defer and not deferrable_step(st.params, n_out, has_mask):
                deferrable = False
            if not (fast or (defer and deferrable)):
                break
        argmax_l: list[int] = []
        packed = self._fused_greedy(h) if fast and self.fused_greedy else None
        if packed is not None:  # [tokens; exact non-finite flags], int64 [2R]
            if defer and deferrable:  # (fast implies deferrable)
                self._sample_deferred(order, sample_b, packed, None, launched)
                return
            host = packed.tolist()  # one device -> host copy
            argmax_l = host[:r_total]
            bad = nonfinite_rows(None, host[r_total:])
        else:
            logits = self.model.compute_logits(h)  # [R, V] float32
            # Non-finite check: NaN/inf in a row make its sum non-finite; rows whose sum is not
            # finite are re-checked exactly (finite values can overflow a sum). One reduction
            # instead of isfinite + all over [R, V].
            suspect_t = ~torch.isfinite(logits.sum(dim=-1))
            if defer and deferrable:
                if fast:
                    tokens_t = logits.argmax(dim=-1)
                else:
                    rows = [self._row(self.requests[order[b][0]]) for b in sample_b]
                    tokens_t = self.sampler.sample_tokens(logits, rows)
                flat = torch.cat([tokens_t, suspect_t.to(tokens_t.dtype)])
                self._sample_deferred(order, sample_b, flat, logits, launched)
                return
            if fast:  # tokens and flags come back in one device -> host copy
                argmax_t = logits.argmax(dim=-1)
                host = torch.cat([argmax_t, suspect_t.to(argmax_t.dtype)]).tolist()
                argmax_l, suspect = host[:r_total], host[r_total:]
            else:
                suspect = suspect_t.tolist()
            bad = nonfinite_rows(logits, suspect)
        good: list[int] = []  # indices into sample_b
        for j, b in enumerate(sample_b):
            r0, n = spans[j]
            if bad and any(r in bad for r in range(r0, r0 + n)):
                out.errors[order[b][0]] = NONFINITE_ERROR
            else:
                good.append(j)
        if not good:
            return
        if fast:
            tokens = [[argmax_l[spans[j][0]]] for j in good]
            lps: list[list[TokenLogprobs] | None] = [None] * len(good)
        else:
            tokens, lps = self._sample_rows(so, order, sample_b, drafts, logits, spans, good)
        for k, j in enumerate(good):
            rid = order[sample_b[j]][0]
            st = self.requests[rid]
            st.token_ids.extend(tokens[k])
            # KV is valid up to the last accepted draft; the new last token is computed next.
            st.num_computed_tokens = len(st.token_ids) - 1
            out.sampled_token_ids[rid] = tokens[k]
            sampled_ok.add(rid)
            if lps[k] is not None:
                out.logprobs[rid] = lps[k]

    def _fused_greedy(self, h: torch.Tensor) -> torch.Tensor | None:
        """Argmax tokens and exact non-finite flags of the rows of h through the fused kernel:
        int64 [2R], tokens then 0/1 flags. None when the model has no raw logits (scaling /
        soft-cap: the float32 path keeps their exact ties)."""
        raw_fn = getattr(self.model, "compute_logits_raw", None)
        raw = raw_fn(h) if raw_fn is not None else None
        if raw is None:
            return None
        from xlaserve.kernels_cuda.sampling import greedy_argmax_packed

        return greedy_argmax_packed(raw, kernels=self.kernels)

    def _sample_deferred(
        self,
        order: list[tuple[str, int]],
        sample_b: list[int],
        flat: torch.Tensor,
        logits: torch.Tensor | None,
        launched: _Launched,
    ) -> None:
        """Sampling without waiting: flat = [tokens; non-finite flags] (int64 [2R], device) goes
        to pinned host memory in the background; each sampling request gets a PENDING token (row
        r of the tokens), which the next launch can feed on the device and `finish` fills in.
        The flags are exact when logits is None (the fused greedy kernel), else suspects that
        `finish` re-checks against logits [R, V]."""
        self.num_deferred_steps += 1
        if flat.is_cuda:
            if self._token_ring is None:  # 4 slots: at most 2 launches are unread at once
                r = self.config.scheduler.max_num_seqs  # rows: one per request (no drafts)
                self._token_ring = PinnedRing(slots=4, nbytes=16 * r)
            host, k = self._token_ring.take(flat.numel(), flat.dtype)
            host.copy_(flat, non_blocking=True)
            launched.ready = self._token_ring.record(k)
        else:
            host = flat
        launched.host, launched.logits, launched.num_rows = host, logits, len(sample_b)
        self._last_argmax = flat[: len(sample_b)]
        for row, b in enumerate(sample_b):  # one row per request (no drafts on this path)
            rid = order[b][0]
            st = self.requests[rid]
            launched.pending.append((rid, st, len(st.token_ids), row))
            st.token_ids.append(PENDING)
            st.num_computed_tokens = len(st.token_ids) - 1
            st.pending_row = row

    @staticmethod
    def _row(st: _ReqState) -> SamplingRow:
        """A SamplingRow for a `deferrable_step` request (no token history needed)."""
        return SamplingRow(params=st.params, prompt_ids=[], output_ids=[], generator=st.generator)

    def _sample_rows(
        self,
        so: SchedulerOutput,
        order: list[tuple[str, int]],
        sample_b: list[int],
        drafts: list[list[int]],
        logits: torch.Tensor,
        spans: list[tuple[int, int]],
        good: list[int],
    ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """The general path: SamplingRows of the good requests -> Sampler / Sampler.verify.
        Returns tokens and logprobs per good request."""
        dev = self.device
        keep = [r for j in good for r in range(spans[j][0], spans[j][0] + spans[j][1])]
        if len(keep) != logits.shape[0]:
            logits = logits[torch.tensor(keep, device=dev)]
        rows: list[SamplingRow] = []
        for j in good:
            rid = order[sample_b[j]][0]
            st = self.requests[rid]
            ds = drafts[sample_b[j]]
            mask = so.grammar_bitmask.get(rid)
            if mask is not None:
                mask = mask.reshape(-1, mask.shape[-1])
                if mask.shape[0] < 1 + len(ds):
                    raise ValueError(
                        f"req {rid}: grammar bitmask has {mask.shape[0]} rows for {1 + len(ds)} "
                        "scored positions (need one row per position)"
                    )
            # The sampler reads prompt/output tokens only for penalties (output: also its length
            # for min_tokens): skip the copies otherwise.
            p = st.params
            prompt = st.token_ids[: st.num_prompt_tokens] if p.needs_penalties else []
            output = st.output_ids if p.needs_penalties or p.min_tokens else []
            for i in range(1 + len(ds)):
                rows.append(
                    SamplingRow(
                        params=st.params,
                        prompt_ids=prompt,
                        output_ids=output + ds[:i] if i else output,
                        generator=st.generator,
                        bitmask=None if mask is None else mask[i],
                    )
                )
        if not any(drafts[sample_b[j]] for j in good):
            res = self.sampler(logits, rows)
            tokens = [[t] for t in res.token_ids]
            lps = [None if e is None else [e] for e in res.logprobs]
        else:
            dl = [drafts[sample_b[j]] for j in good]
            q = None  # draft distributions: EAGLE's sampled drafts (others are one-hot)
            if self.eagle is not None:
                q = self.eagle.draft_probs([order[sample_b[j]][0] for j in good], dl)
            vres = self.sampler.verify(logits, rows, dl, q)
            tokens, lps = vres.token_ids, vres.logprobs
        return tokens, lps

    # ---- draft model ----------------------------------------------------------------------

    def _draft_table(self, block_ids: list[int], slot: int) -> list[int]:
        """The request's block table + its batch slot's scratch blocks (draft cache only)."""
        if slot >= self._draft_slots:
            raise ValueError(f"draft batch slot {slot} >= max_num_seqs {self._draft_slots}")
        base = self.num_blocks + slot * self._draft_scratch
        return block_ids + list(range(base, base + self._draft_scratch))

    def _draft_quota(self, st: _ReqState) -> int:
        """Drafts worth proposing: never past max_tokens or max_model_len (the bonus token
        of the verification step counts too)."""
        max_tokens = st.params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - st.num_prompt_tokens
        left = min(max_tokens - len(st.output_ids), self.max_model_len - len(st.token_ids))
        return max(0, min(self.num_spec_tokens, left - 1))

    def _propose(
        self,
        order: list[tuple[str, int]],
        starts: list[int],
        ends: list[int],
        sampled_ok: set[str],
    ) -> dict[str, list[int]]:
        """Catch the draft model up on this step's verified tokens, then propose greedily."""
        assert self.draft_model is not None
        chunks: list[tuple[list[int], int, list[int]]] = []
        want: list[tuple[str, int, int]] = []  # (req id, chunk index, quota)
        for b, (rid, _) in enumerate(order):
            st = self.requests[rid]
            stop = len(st.token_ids) if rid in sampled_ok else min(ends[b], len(st.token_ids))
            toks = st.token_ids[starts[b] : stop]
            if not toks:
                continue
            chunks.append((toks, starts[b], self._draft_table(st.block_ids, len(chunks))))
            quota = self._draft_quota(st) if rid in sampled_ok else 0
            if quota > 0:
                want.append((rid, len(chunks) - 1, quota))
        if not chunks:
            return {}
        ids, pos, md = self._build_inputs(chunks)
        hidden = self.draft_model(ids, pos, self.draft_kv_caches, md)
        if not want:
            return {}
        qsl = md.query_start_loc_host
        last = torch.tensor([qsl[c + 1] - 1 for _, c, _ in want], device=self.device)
        nxt = self.draft_model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        proposals = {rid: [t] for (rid, _, _), t in zip(want, nxt, strict=True)}
        for step in range(1, max(q for _, _, q in want)):
            active = [(rid, c) for rid, c, q in want if q > step]
            step_chunks = [
                (
                    [proposals[rid][-1]],
                    len(self.requests[rid].token_ids) - 1 + step,
                    chunks[c][2],
                )
                for rid, c in active
            ]
            ids, pos, md = self._build_inputs(step_chunks)
            hidden = self.draft_model(ids, pos, self.draft_kv_caches, md)
            nxt = self.draft_model.compute_logits(hidden).argmax(dim=-1).tolist()
            for (rid, _), t in zip(active, nxt, strict=True):
                proposals[rid].append(t)
        return proposals

    def _prompt_logprobs(
        self, st: _ReqState, hidden: torch.Tensor, start: int
    ) -> list[TokenLogprobs]:
        """Rows of `hidden` [n, H] are positions start..start+n-1; row j predicts token j + 1.
        Returns entries for prompt positions p = start+1 .. min(start+n, P-1) in order."""
        num_prompt = st.num_prompt_tokens
        n = min(hidden.shape[0], num_prompt - 1 - start)
        if n <= 0:
            return []
        logits = self.model.compute_logits(hidden[:n])
        lp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(st.token_ids[start + 1 : start + 1 + n], device=lp.device)
        return token_logprobs(lp, targets, [st.params.prompt_logprobs] * n)
