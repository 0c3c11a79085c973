"""TorchModelRunner: the Torch backend's ModelRunner (CPU path; the GPU path builds on it).

The persistent batch, step validation, numpy step inputs and output bookkeeping are
xlaserve/runner_core.py's (shared with the XLA runner); this file does the device work: inputs to
tensors and attention metadata, the forward, sampling of requests whose chunk reaches the end of
their known tokens, CUDA graphs (cuda_graphs.py). Speculative decoding: a request with d drafts
has its last 1 + d positions verified by `Sampler.verify` (greedy / lossless rejection sampling);
drafts come from the engine (n-gram), a draft model (draft.py) or an EAGLE head (eagle.py).

Async scheduling (xlaserve.runner, `launch` / `finish`): `launch` returns without waiting when
every sampling request takes the greedy fast path; its tokens are PENDING placeholders copied to
pinned host memory in the background. A request scheduled again before `finish` has its PENDING
last input fed on the device from the previous launch's argmax tensor: the GPU never waits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from xlaserve.backends_torch.distributed.parallel_state import tp_world_size
from xlaserve.backends_torch.layers.attention import (
    AttentionMetadata,
    check_kv_cache_dtype,
    get_attention_backend,
)
from xlaserve.backends_torch.memory import (
    alloc_kv_caches,
    kv_bytes_per_block,
    profile_cuda_blocks,
    resolve_dtype,
)
from xlaserve.backends_torch.models import get_model_class
from xlaserve.backends_torch.sampler import (
    PinnedRing,
    Sampler,
    SamplingRow,
    defer_ok,
    forbidden_from_bytes,
    forbidden_tokens,
    is_plain_greedy,
    nonfinite_rows,
    prompt_logprobs,
    sample_requests,
    stop_mask_until,
    to_device,
)
from xlaserve.config import EngineConfig, KernelConfig
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.platforms import current_platform
from xlaserve.quantization.kv_quant import KV_CACHE_DTYPES
from xlaserve.quantization.scheme import METHODS as QUANT_METHODS
from xlaserve.runner import (
    ModelRunner,
    NewRequestData,
    RunnerCapabilities,
    RunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from xlaserve.runner_core import (
    NONFINITE_ERROR,
    PENDING,
    LaunchedStep,
    ReqState,
    RunnerCore,
    ragged_inputs,
)

__all__ = ["NONFINITE_ERROR", "PENDING", "TorchModelRunner", "nonfinite_rows", "resolve_dtype"]

logger = logging.getLogger(__name__)


def pack_bitmask_rows(out: np.ndarray, masks: list[np.ndarray | None]) -> None:
    """Write a step's packed grammar bitmasks into out, int32 [R, W] (W = the logits' words),
    row r from masks[r] (int32 [1, W'] or None). Rules: a row without a mask allows everything
    (-1); a mask wider than W is cut to W; a short one allows everything past its end.

    The common case at large batch (every row constrained, masks exactly W wide, as the
    structured-output manager returns them) is ONE np.concatenate into out: measured on this
    box at 256 x 4,008 words, 0.15 ms vs 0.35 ms for a Python loop of per-row copies. Only
    rows that need -1 are filled (not the whole buffer: 4 MB at 256 rows of a 128k vocab)."""
    rows, words = out.shape
    if len(masks) != rows:
        raise ValueError(f"{len(masks)} masks for {rows} rows")
    if all(
        isinstance(m, np.ndarray) and m.shape == (1, words) and m.dtype == np.int32 for m in masks
    ):
        np.concatenate(masks, axis=0, out=out)
        return
    for r, m in enumerate(masks):
        if m is None:
            out[r] = -1
            continue
        flat = np.asarray(m, dtype=np.int32).reshape(-1)[:words]
        out[r, : flat.shape[0]] = flat
        if flat.shape[0] < words:
            out[r, flat.shape[0] :] = -1


@dataclass
class _ReqState(ReqState):
    """The persistent batch's request (runner_core.ReqState) + torch sampling state."""

    generator: torch.Generator | None = None
    extra: dict = field(default_factory=dict)
    # Per-request constants of the sampling fast path (set from params at creation).
    plain_greedy: bool = False  # sampler.is_plain_greedy(params)
    defer_ok: bool = False  # sampler.defer_ok(params)
    stop_mask_until: int = 0  # sampler.stop_mask_until(params)
    lora_slot: int = -1  # NewRequestData.lora_slot (-1: the base model)


ENV_FUSED_GREEDY = KernelConfig.env_name("fused_greedy")


@dataclass
class _Launched(LaunchedStep):
    """A launched step (`TorchModelRunner.launch`): for a greedy fast-path step, the device
    tensors whose values `finish` still has to read (pending rows: logits rows)."""

    host: torch.Tensor | None = None  # pinned [2R]: argmax tokens, then non-finite flags
    ready: torch.cuda.Event | None = None
    # [R, V], kept for the exact non-finite re-check; None when the flags are exact (fused greedy).
    logits: torch.Tensor | None = None
    num_rows: int = 0
    # Sampling still to run (late grammar bitmasks, `apply_bitmasks`): it takes the masks.
    resume: Callable[[dict], None] | None = None
    # With `resume`: the ids of the sampling requests in row order, and the buffer handed out
    # by `late_bitmask_buffer`: (pinned slot or None on the CPU, ring index, int32 [R, W] view),
    # kept for the step's sampling only when the masks were filled into it.
    sample_rids: list[str] | None = None
    mask_slot: tuple[torch.Tensor | None, int, np.ndarray] | None = None


class TorchModelRunner(RunnerCore):
    """Implements `xlaserve.runner.ModelRunner` with Torch models. Constructed as cls(config, spec)."""

    capabilities: ClassVar[RunnerCapabilities] = RunnerCapabilities(
        tensor_parallel=True, speculative_methods=("ngram", "draft_model", "eagle"),
        kv_offload=True, quantization=QUANT_METHODS, kv_cache_dtypes=KV_CACHE_DTYPES,
        async_scheduling=True, lora=True,
    )  # fmt: skip

    @classmethod
    def create(cls, config: EngineConfig, spec: ModelSpec) -> ModelRunner:
        """tensor_parallel_size > 1: an executor over one runner per rank (distributed/)."""
        if config.parallel.tensor_parallel_size > 1:
            from xlaserve.backends_torch.distributed.executor import make_executor

            return make_executor(config, spec)
        return cls(config, spec)

    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        super().__init__()  # the persistent batch: self.requests (runner_core.py)
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
        if spec.alibi_slopes is not None or spec.attn_sinks:  # no Triton kernel takes them yet
            default_attn = "torch_batched"
        ab = self.kernels.attention_backend
        self.attn_backend_name = default_attn if ab == "auto" else ab
        self.attn_backend = get_attention_backend(self.attn_backend_name, self.kernels)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
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
        self._mask_ring: PinnedRing | None = None  # pinned host slots for late grammar masks
        self._mask_stream: torch.cuda.Stream | None = None  # their uploads (`_device_bitmask`)
        # Late masks filled in place (`late_bitmask_buffer`): the CPU's buffer, and how many
        # steps' masks went up from there (tests, benchmarks).
        self._cpu_masks: np.ndarray | None = None  # the CPU's reused [max_num_seqs, W] buffer
        self.num_masks_in_place = 0
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
            from xlaserve.backends_torch.draft import draft_model_spec

            self.draft_spec = draft_model_spec(config, spec)
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
        # Recurrent-state models (Mamba, hybrids): state slots beside the KV blocks (state.py).
        from xlaserve.backends_torch.state import check_state_model_config, is_state_model

        check_state_model_config(config, spec)
        self.state_model = is_state_model(spec)
        self._num_state_slots = 0
        # Multi-LoRA (backends_torch/lora.py): slot tables + hooks, made by load_model.
        self.lora = None
        if config.lora.enable_lora:
            from xlaserve.backends_torch.lora import check_lora_support

            check_lora_support(config, spec)

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
        model.cover_positions(self.max_model_len)  # rope tables up to max_model_len
        self.model = model.eval()
        if self.config.lora.enable_lora:
            from xlaserve.backends_torch.lora import TorchLoRA

            self.lora = TorchLoRA(model, self.spec, self.config, self.device, self.dtype)
        if self.draft_spec is not None:
            from xlaserve.backends_torch.draft import load_draft_model

            self.draft_model = load_draft_model(self)
        if self.eagle is not None:
            self.eagle.load()

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block id: the target's KV + the draft's / EAGLE head's (memory.py)."""
        return kv_bytes_per_block(self)

    def determine_num_kv_blocks(self) -> int:
        cache = self.config.cache
        if self.state_model:  # one budget -> KV blocks + state slots (state.py)
            from xlaserve.backends_torch.state import split_cache

            self._num_state_slots = 1  # the profiling forward's
            cuda = self.device.type == "cuda" and cache.num_kv_blocks is None
            budget = profile_cuda_blocks(self, 1) if cuda else cache.cpu_kv_cache_bytes
            n, self._num_state_slots = split_cache(self, budget)
            return n
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type != "cuda":
            n = cache.cpu_kv_cache_bytes // per_block
        else:
            n = profile_cuda_blocks(self, per_block)
        if n <= 0:
            raise RuntimeError(
                f"no memory left for the KV cache ({per_block} bytes per block): lower max_num_batched_tokens, "
                "raise gpu_memory_utilization / cpu_kv_cache_bytes, or use a smaller model"
            )
        return int(n)

    def _dummy_forward(self, tokens: int, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(tokens, device=self.device)
        # (A state model's first layer may hold state slots, not blocks.)
        nblk = -(-tokens // self.block_size) if self.state_model else caches[0][0].shape[0]
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
        if self.state_model:
            md.derived.update(state_slots=[0], state_fresh=[True])
        hidden = self.model(ids, pos, caches, md)
        # Sampling holds logits of up to max_num_seqs rows [B, V] float32 at once.
        self.model.compute_logits(hidden[-min(tokens, self.config.scheduler.max_num_seqs) :])

    def _alloc_caches(
        self, num_blocks: int, spec: ModelSpec | None = None
    ) -> list[tuple[torch.Tensor, ...]]:
        """This rank's KV cache of `spec` (default: the target's), memory.py; with state slots
        for recurrent-state models (state.py)."""
        if spec is None and self.state_model:
            from xlaserve.backends_torch.state import alloc_caches

            return alloc_caches(self.spec, num_blocks, max(self._num_state_slots, 1),
                                self.block_size, self.dtype, self.device)  # fmt: skip
        return alloc_kv_caches(num_blocks, self.block_size, spec or self.spec, self.dtype,
                               self.kv_code_dtype, self.device)  # fmt: skip

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
        # Decode CUDA graphs, recurrent-state models included (their padding rows use the
        # scratch state slot, state_scratch_slot).
        if self.device.type == "cuda" and self.attn_backend.cuda_graphs:
            from xlaserve.backends_torch.cuda_graphs import make_cuda_step_runner

            self.cuda_step = make_cuda_step_runner(self)
        self._warm_fused_greedy()

    def num_state_slots(self) -> int:
        """State slots allocated beside the KV blocks (0: attention-only model; runner.py)."""
        return self._num_state_slots

    def state_scratch_slot(self) -> int:
        """The spare state slot after the requests' (state.alloc_caches): decode-graph padding
        rows and warm-up steps use it; the cache manager never hands it out."""
        return max(self._num_state_slots, 1)

    def _warm_fused_greedy(self) -> None:
        """Compile the fused greedy kernel's variants at start-up, not in the first steps: the
        row counts 1 (most chunks) and max_num_seqs (fewest) cover every step's chunking, with
        and without grammar bitmasks."""
        if not (self.fused_greedy and self.device.type == "cuda"):
            return
        from xlaserve.kernels_cuda import sampling

        raw_fn = getattr(self.model, "compute_logits_raw", None)
        for rows in (1, self.config.scheduler.max_num_seqs):
            h = torch.zeros((rows, self.spec.hidden_size), dtype=self.dtype, device=self.device)
            self._fused_greedy(h)
            raw = raw_fn(h) if raw_fn is not None else None
            if raw is not None:  # the masked variant, every token allowed (no pinned slots)
                words = (raw.shape[1] + 31) // 32
                allow = torch.full((rows, words), -1, dtype=torch.int32, device=self.device)
                sampling.greedy_argmax_packed(raw, kernels=self.kernels, bitmask=allow)
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

    def _new_state(self, nr: NewRequestData) -> _ReqState:
        p = nr.sampling_params
        return _ReqState(
            token_ids=list(nr.token_ids),
            num_prompt_tokens=nr.num_prompt_tokens,
            params=p,
            block_ids=list(nr.block_ids),
            num_computed_tokens=nr.num_computed_tokens,
            generator=self.sampler.make_generator(p.seed) if p.seed is not None else None,
            emit_prompt_logprobs=p.prompt_logprobs is not None
            and len(nr.token_ids) == nr.num_prompt_tokens,
            plain_greedy=is_plain_greedy(p),
            defer_ok=defer_ok(p),
            stop_mask_until=stop_mask_until(p),
            lora_slot=nr.lora_slot,
        )

    def _build_inputs(
        self, chunks: list[tuple[list[int], int, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """chunks: per request (token ids to compute, position of the first, block table).
        Returns input ids [T], positions [T] and the attention metadata of the ragged batch."""
        dev = self.device
        x = ragged_inputs(chunks, self.block_size)  # numpy (runner_core.py)
        qsl_host, seq_lens_host = x.query_start_loc.tolist(), x.seq_lens.tolist()
        md = self.attn_backend.build_metadata(
            query_start_loc=torch.from_numpy(x.query_start_loc.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(x.seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(x.block_tables).to(dev),
            slot_mapping=torch.from_numpy(x.slot_mapping).to(dev),
            max_query_len=x.max_query_len,
            max_seq_len=max(seq_lens_host),
            query_start_loc_host=qsl_host,
            seq_lens_host=seq_lens_host,
        )
        input_ids = torch.from_numpy(x.input_ids).to(dev)
        pos_t = torch.from_numpy(x.positions).to(dev)
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

    def late_bitmask_buffer(self, launched: _Launched, req_ids: list[str]) -> np.ndarray | None:
        """Where the engine may fill a launched step's late grammar bitmasks in place: a pinned
        upload slot, int32 [R, W], row r for the step's r-th sampling request, when those are
        exactly `req_ids` in this order (every sampling request constrained) on CUDA. None
        otherwise: the masks are then packed into a slot when the step samples (one host copy
        of R x W words more: 4 MB at batch 256 of a 128k vocabulary)."""
        if launched.resume is None or not req_ids or launched.sample_rids != req_ids:
            return None
        words = (self.spec.vocab_size + 31) // 32
        rows = self.config.scheduler.max_num_seqs
        if len(req_ids) > rows:
            return None
        if self.device.type != "cuda":  # read synchronously by `_masked`: one buffer serves
            if self._cpu_masks is None:
                self._cpu_masks = np.empty((rows, words), np.int32)
            view = self._cpu_masks[: len(req_ids)]
            launched.mask_slot = (None, -1, view)
            return view
        slot = self._mask_ring_for(words).take(len(req_ids) * words, torch.int32)
        if slot is None:
            return None
        host, k = slot
        view = host.view(len(req_ids), words).numpy()
        launched.mask_slot = (host, k, view)
        return view

    def apply_bitmasks(self, launched: _Launched, bitmasks: dict) -> None:
        """The late grammar bitmasks of a launched step (xlaserve.runner): its sampling, held
        back at launch, runs now with them, applied on the device (no host sync). Masks that
        were filled into the step's `late_bitmask_buffer` go up from there as they are."""
        resume, launched.resume = launched.resume, None
        slot = launched.mask_slot
        if resume is None:
            launched.mask_slot = None
            return
        if slot is not None:
            first = bitmasks.get(launched.sample_rids[0]) if launched.sample_rids else None
            # The manager fills the buffer it was given whole or not at all (fill_job): the
            # slot holds this step's masks iff the first one is its first row.
            if first is None or first.ctypes.data != slot[2].ctypes.data:
                launched.mask_slot = None
        try:
            resume(bitmasks)  # `_masked` reads launched.mask_slot
        finally:
            launched.mask_slot = None

    def finish(self, launched: _Launched) -> RunnerOutput:
        if launched.resume is not None:  # masks never came (an error in the engine): sample
            self.apply_bitmasks(launched, {})
        return super().finish(launched)

    def _read_pending(self, launched: _Launched) -> tuple[list[int], set[int]]:
        """`finish` (runner_core.py): wait for the pinned copy; tokens and non-finite rows."""
        h = launched
        if h.ready is not None:
            h.ready.synchronize()
        host = h.host.tolist()
        bad = nonfinite_rows(h.logits, host[h.num_rows :])
        h.logits = None
        return host, bad

    def _launch(self, scheduler_output: SchedulerOutput, defer: bool) -> _Launched:
        so = scheduler_output
        if so.has_kv_copies:  # before the forward, in the order runner.py documents
            if self.kv_offload is None:
                raise RuntimeError("KV offload copies scheduled but kv_offload_bytes is 0")
            self.kv_offload.apply(so.kv_disk_out, so.kv_copy_out, so.kv_disk_in, so.kv_copy_in)
        self._check_drafts(so)
        self._update_states(so)
        if so.lora_loads:  # after finished requests are gone, before the forward
            if self.lora is None:
                raise RuntimeError("LoRA adapters scheduled but enable_lora is off")
            for slot, adapter in so.lora_loads:
                self.lora.load(slot, adapter)
        out = RunnerOutput()
        launched = _Launched(out)
        if not so.num_scheduled_tokens:
            return launched
        assert self.model is not None, "load_model() must run before execute()"

        plan = self._plan_step(so)  # validated chunks, PENDING inputs (runner_core.py)
        order = list(so.num_scheduled_tokens.items())
        states, drafts, starts, chunks = plan.states, plan.drafts, plan.starts, plan.chunks()
        feed_dst, feed_src = plan.feed_dst, plan.feed_src
        feed = (feed_dst, feed_src, self._last_argmax) if feed_dst else None
        if self.lora is not None:  # each token's adapter slot (-1: base)
            self.lora.prepare(
                np.repeat([st.lora_slot for st in states], plan.counts).astype(np.int32)
            )
        if self.cuda_step is not None:  # one H2D upload; decode steps replay a CUDA graph
            step_state = None
            if self.state_model:  # the requests' state slots (state.py)
                from xlaserve.backends_torch.state import step_state as make_step_state

                step_state = make_step_state(states, starts)
            hidden, qsl, seq_lens = self.cuda_step.forward(chunks, feed, step_state)
        else:
            input_ids, pos_t, md = self._build_inputs(chunks)
            if self.state_model:  # the requests' state slots (state.py)
                from xlaserve.backends_torch.state import set_step_state

                set_step_state(md, states, starts)
            if feed is not None:
                from xlaserve.backends_torch.cuda_graphs import feed_tokens

                dev = self.device
                feed_tokens(input_ids, to_device(feed_dst, torch.long, dev),
                            to_device(feed_src, torch.long, dev), self._last_argmax)  # fmt: skip
            qsl, seq_lens = md.query_start_loc_host, md.seq_lens_host
            hidden = self.model(input_ids, pos_t, self.kv_caches, md)  # [T, H]

        # Prompt logprobs for the chunk's prompt positions (before num_computed is advanced).
        for b, st in enumerate(states) if plan.prompt_logprobs else ():
            if st.emit_prompt_logprobs:
                entries = prompt_logprobs(
                    self.model, st, hidden[qsl[b] : qsl[b + 1]], st.num_computed_tokens
                )
                if entries:
                    out.prompt_logprobs[order[b][0]] = entries

        # Requests whose chunk reaches the end of their known tokens (+ drafts) sample.
        sample_b = [b for b, s in enumerate(plan.sampling) if s]
        for b, (rid, n) in enumerate(order):
            states[b].num_computed_tokens = starts[b] + n
            out.sampled_token_ids[rid] = []
        # Deferred tokens only without in-runner drafting (it reads this step's tokens at once).
        defer = defer and self.draft_model is None and self.eagle is None

        def sample(late_masks: dict) -> None:
            so.grammar_bitmask.update(late_masks)
            sampled_ok: set[str] = set()
            if sample_b:
                self._sample(
                    so, order, sample_b, drafts, hidden, qsl, out, sampled_ok, launched, defer
                )
            if launched.pending:
                return
            if self.draft_model is not None:
                from xlaserve.backends_torch.draft import propose

                out.spec_token_ids = propose(self, order, starts, seq_lens, sampled_ok)
            elif self.eagle is not None:
                out.spec_token_ids = self.eagle.propose(
                    order, starts, seq_lens, hidden, qsl, sampled_ok, out.errors
                )

        if so.late_bitmask_req_ids:
            # The forward is queued; sampling waits for the masks (`apply_bitmasks`), which
            # the engine fills while the device runs it.
            launched.resume = sample
            launched.sample_rids = [order[b][0] for b in sample_b]
        else:
            sample({})
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
        # The row rules are sampler.argmax_only_step / deferrable_step over the per-request
        # constants cached at admission (_ReqState): a few attribute reads a row.
        # `greedy`: the same minus "no bitmask": with the fused kernel, grammar rows take the
        # argmax of their allowed tokens inside it (structured output's greedy steps).
        greedy = deferrable = True
        masked_rows = False
        masks = so.grammar_bitmask
        for b in sample_b:
            if drafts[b]:
                greedy = deferrable = False
                break
            rid = order[b][0]
            st = self.requests[rid]
            until = st.stop_mask_until
            stop_masked = until and len(st.token_ids) - st.num_prompt_tokens < until
            if greedy and (not st.plain_greedy or stop_masked):
                greedy = False
            masked_rows = masked_rows or rid in masks
            # A deferred step applies its bitmask rows on the device (`_masked`): no host data.
            if defer and (stop_masked or not st.defer_ok):
                deferrable = False
            if not (greedy or (defer and deferrable)):
                break
        fast = greedy and not masked_rows
        argmax_l: list[int] = []
        packed = None
        if greedy and self.fused_greedy:
            rows_masks = [masks.get(order[b][0]) for b in sample_b] if masked_rows else None
            packed = self._fused_greedy(h, rows_masks, launched.mask_slot)
        if packed is not None:  # [tokens; exact non-finite flags], int64 [2R]
            fast = True  # the tokens are the kernel's argmax (of the allowed tokens)
            if defer and deferrable:  # (greedy implies deferrable)
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
                    # The raw logits stay for `finish`'s exact non-finite re-check.
                    masked = self._masked(
                        logits,
                        [so.grammar_bitmask.get(order[b][0]) for b in sample_b],
                        launched.mask_slot,
                    )
                    tokens_t = self.sampler.sample_tokens(masked, rows)
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
                self._fail(out, order[b][0])
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
            self._accept(out, rid, self.requests[rid], tokens[k])
            sampled_ok.add(rid)
            if lps[k] is not None:
                out.logprobs[rid] = lps[k]

    def _fused_greedy(
        self,
        h: torch.Tensor,
        masks: list[np.ndarray | None] | None = None,
        in_place: tuple[torch.Tensor | None, int, np.ndarray] | None = None,
    ) -> torch.Tensor | None:
        """Argmax tokens and exact non-finite flags of the rows of h through the fused kernel:
        int64 [2R], tokens then 0/1 flags. masks (one per row, as `_masked` takes them, with
        its `in_place` slot): each row's argmax over its grammar's allowed tokens. None when the
        model has no raw logits (scaling / soft-cap: the float32 path keeps their exact ties)."""
        raw_fn = getattr(self.model, "compute_logits_raw", None)
        raw = raw_fn(h) if raw_fn is not None else None
        if raw is None:
            return None
        from xlaserve.kernels_cuda import sampling

        bits = None
        if masks is not None:
            bits = self._device_bitmask(masks, in_place, (raw.shape[1] + 31) // 32)
        return sampling.greedy_argmax_packed(raw, kernels=self.kernels, bitmask=bits)

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
            self._defer_token(launched, rid, self.requests[rid], row)

    def _masked(
        self,
        logits: torch.Tensor,
        masks: list[np.ndarray | None],
        in_place: tuple[torch.Tensor | None, int, np.ndarray] | None = None,
    ) -> torch.Tensor:
        """logits [R, V] with each row's grammar bitmask applied (disallowed -> -inf), a new
        tensor; masks[r]: int32 [1, W] or None (row r unconstrained); the packed rows come from
        `_device_bitmask` and are unpacked on the device."""
        if all(m is None for m in masks):
            return logits
        vocab = logits.shape[1]
        bits = self._device_bitmask(masks, in_place, (vocab + 31) // 32)
        if bits.device.type != "cuda":
            forbidden = forbidden_tokens(bits.numpy(), vocab, bits.device)
        else:  # unpacking bytes moves a quarter of what int32 words would
            forbidden = forbidden_from_bytes(bits.view(torch.uint8), vocab)
        return logits.masked_fill(forbidden, float("-inf"))

    def _device_bitmask(
        self,
        masks: list[np.ndarray | None],
        in_place: tuple[torch.Tensor | None, int, np.ndarray] | None,
        words: int,
    ) -> torch.Tensor:
        """A step's grammar masks as ONE packed int32 [R, W] tensor on the runner's device, row
        r from masks[r] (int32 [1, W'] or None: every token; `pack_bitmask_rows`). On CUDA the
        rows go up through a pinned slot and a non-blocking copy, without waiting for the
        queued forward. `in_place`: the step's `late_bitmask_buffer` slot when the engine filled
        the masks into it (nothing to pack)."""
        dev = self.device
        if in_place is not None and in_place[2].shape != (len(masks), words):
            in_place = None
        if in_place is not None:
            self.num_masks_in_place += 1
        if dev.type != "cuda":
            if in_place is not None:
                return torch.from_numpy(in_place[2])  # the engine filled the masks here already
            packed = np.empty((len(masks), words), dtype="<i4")
            pack_bitmask_rows(packed, masks)
            return torch.from_numpy(packed)
        ring = self._mask_ring_for(words)
        if in_place is not None and in_place[0] is not None:
            host, k = in_place[0], in_place[1]  # the engine filled the masks into this slot
        else:
            slot = ring.take(len(masks) * words, torch.int32)
            assert slot is not None, "more sampling rows than max_num_seqs on a deferred step"
            host, k = slot
            pack_bitmask_rows(host.view(len(masks), words).numpy(), masks)
        # On a side stream: on the compute stream the copy would queue behind the step's whole
        # forward (4 MB at 256 rows of a 128k vocabulary); here it runs beside it, and only the
        # sampling that reads the masks waits for it.
        if self._mask_stream is None:
            self._mask_stream = torch.cuda.Stream(dev)
        compute = torch.cuda.current_stream(dev)
        with torch.cuda.stream(self._mask_stream):
            bits = host.to(dev, non_blocking=True)  # [R * W]
            ring.record(k)  # the slot is free again once this copy is done
        compute.wait_stream(self._mask_stream)
        bits.record_stream(compute)  # allocated on the side stream, read on the compute one
        return bits.view(len(masks), words)

    def _mask_ring_for(self, words: int) -> PinnedRing:
        """The pinned slots of late grammar masks (4: at most 2 launches are unread at once),
        each max_num_seqs rows of `words` int32 words."""
        if self._mask_ring is None:
            self._mask_ring = PinnedRing(
                slots=4, nbytes=4 * words * self.config.scheduler.max_num_seqs
            )
        return self._mask_ring

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
        """The general path: the good requests' rows of logits -> Sampler / Sampler.verify
        (sampler.sample_requests). Returns tokens and logprobs per good request."""
        keep = [r for j in good for r in range(spans[j][0], spans[j][0] + spans[j][1])]
        if len(keep) != logits.shape[0]:
            logits = logits[torch.tensor(keep, device=self.device)]
        rids = [order[sample_b[j]][0] for j in good]
        dl = [drafts[sample_b[j]] for j in good]
        # Draft distributions: EAGLE's sampled drafts (others are one-hot).
        q = self.eagle.draft_probs(rids, dl) if self.eagle is not None and any(dl) else None
        states = [self.requests[rid] for rid in rids]
        # `logits` are this step's own (compute_logits, or the gathered good rows), read
        # no more after sampling: the sampler may mask them in place (inference mode: they
        # are inference tensors).
        with torch.inference_mode():
            return sample_requests(
                self.sampler, logits, rids, states, dl, so.grammar_bitmask, q, owned=True
            )
