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
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch

from xlaserve.backends_torch.distributed.parallel_state import kv_heads_per_rank, tp_world_size
from xlaserve.backends_torch.layers.attention import AttentionMetadata, get_attention_backend
from xlaserve.backends_torch.models import get_model_class
from xlaserve.backends_torch.sampler import Sampler, SamplingRow, token_logprobs
from xlaserve.config import EngineConfig
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

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class TorchModelRunner:
    """Implements `xlaserve.runner.ModelRunner` with Torch models. Constructed as cls(config, spec)."""

    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        self.config = config
        self.spec = spec
        self.device = torch.device(current_platform.torch_device())
        self.dtype = resolve_dtype(config.model.dtype, spec.checkpoint_dtype, self.device.type)
        # Weight quantization (None = float); raises early for unsupported fp8 / kv_cache_dtype.
        from xlaserve.backends_torch.layers.linear import torch_quant_scheme

        self.quant_scheme = torch_quant_scheme(config, spec, self.device)
        self.block_size = config.cache.block_size
        # CUDA: Triton paged attention (graph-capturable); elsewhere one batched torch attention.
        default_attn = "triton" if self.device.type == "cuda" else "torch_batched"
        self.attn_backend_name = os.environ.get("XLASERVE_ATTENTION_BACKEND", default_attn)
        self.attn_backend = get_attention_backend(self.attn_backend_name)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.requests: dict[str, _ReqState] = {}
        self.sampler = Sampler(self.device, seed=config.model.seed)
        # CUDA step executor (one packed metadata upload, decode CUDA graphs); see init_kv_cache.
        self.cuda_step = None
        # KV offload copy engine (host/disk tiers), made by init_kv_cache when configured.
        self.kv_offload = None
        self.max_model_len = config.model.max_model_len or spec.max_position_embeddings
        # Draft model (speculative method "draft_model"): its spec, module and KV cache.
        sc = config.speculative
        self.num_spec_tokens = sc.num_speculative_tokens if sc is not None else 0
        self.draft_spec: ModelSpec | None = None
        self.draft_model: torch.nn.Module | None = None
        self.draft_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if sc is not None and sc.method == "eagle":
            raise NotImplementedError(
                "speculative method 'eagle' is not implemented in the torch runner"
            )
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

    # ---- setup ----------------------------------------------------------------------------

    def load_model(self) -> None:
        cls = get_model_class(self.spec.family)
        torch.manual_seed(self.config.model.seed)
        model = cls(self.spec, dtype=self.dtype, device=self.device, attn_backend=self.attn_backend)
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
        self.model = model.eval()
        if self.draft_spec is not None:
            dcls = get_model_class(self.draft_spec.family)
            draft = dcls(
                self.draft_spec,
                dtype=self.dtype,
                device=self.device,
                attn_backend=self.attn_backend,
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

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block id: the target's KV plus, with a draft model, the draft's KV."""
        elem = torch.empty((), dtype=self.dtype).element_size()

        def rank_bytes(spec: ModelSpec) -> int:  # this rank's KV heads only (tensor parallel)
            h = spec.num_kv_heads
            return spec.kv_bytes_per_token(elem) * kv_heads_per_rank(h) // h

        per_token = rank_bytes(self.spec)
        if self.draft_spec is not None:
            per_token += rank_bytes(self.draft_spec)
        return self.block_size * per_token

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
            k.numel() * k.element_size() * 2 for k, _ in caches
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
        md = AttentionMetadata(
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
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(spec.num_layers)
        ]

    def init_kv_cache(self, num_blocks: int) -> None:
        """Per layer K and V tensors [N, S, Hkv, D] (the draft's: N + scratch blocks)."""
        self.num_blocks = num_blocks
        self.kv_caches = self._alloc_caches(num_blocks)
        if self.draft_spec is not None:
            scratch = self._draft_scratch * self._draft_slots
            self.draft_kv_caches = self._alloc_caches(num_blocks + scratch, self.draft_spec)
        from xlaserve.backends_torch.kv_offload import make_torch_kv_offload

        self.kv_offload = make_torch_kv_offload(self)
        if self.device.type == "cuda" and self.attn_backend_name == "triton":
            from xlaserve.backends_torch.cuda_graphs import make_cuda_step_runner

            self.cuda_step = make_cuda_step_runner(self)

    def shutdown(self) -> None:
        self.cuda_step = None  # its CUDA graphs hold the KV cache and their memory pool
        self.kv_caches = []
        self.draft_kv_caches = []
        self.draft_model = None
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
        S, dev = self.block_size, self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        for toks, start, table in chunks:
            end = start + len(toks)
            ids.extend(toks)
            positions.extend(range(start, end))
            slots.extend(table[p // S] * S + p % S for p in range(start, end))
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
        max_blocks = max(len(t) for _, _, t in chunks)
        table_t = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for i, (_, _, t) in enumerate(chunks):
            table_t[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        md = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table_t.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            max_query_len=max(len(c[0]) for c in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_host=qsl,
            seq_lens_host=seq_lens,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, torch.tensor(positions, dtype=torch.long, device=dev), md

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
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
        if not so.num_scheduled_tokens:
            return out
        assert self.model is not None, "load_model() must run before execute()"

        S = self.block_size
        order = list(so.num_scheduled_tokens.items())
        chunks: list[tuple[list[int], int, list[int]]] = []
        drafts: list[list[int]] = []
        starts: list[int] = []
        for rid, n in order:
            st = self.requests[rid]
            ds = list(so.spec_token_ids.get(rid, ()))
            known = st.token_ids + ds if ds else st.token_ids
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            if end > len(known):
                raise ValueError(
                    f"req {rid}: scheduled up to token {end} but only {len(known)} tokens are known"
                )
            if ds and end != len(known):
                raise ValueError(
                    f"req {rid}: {len(ds)} drafts scheduled but the chunk ends at {end}"
                )
            if math.ceil(end / S) > len(st.block_ids):
                raise ValueError(
                    f"req {rid}: {end} tokens need {math.ceil(end / S)} blocks, has {len(st.block_ids)}"
                )
            chunks.append((known[start:end], start, st.block_ids))
            drafts.append(ds)
            starts.append(start)
        if self.cuda_step is not None:  # one H2D upload; decode steps replay a CUDA graph
            hidden, qsl, seq_lens = self.cuda_step.forward(chunks)
        else:
            input_ids, pos_t, md = self._build_inputs(chunks)
            qsl, seq_lens = md.query_start_loc_host, md.seq_lens_host
            hidden = self.model(input_ids, pos_t, self.kv_caches, md)  # [T, H]

        # Prompt logprobs for the chunk's prompt positions (before num_computed is advanced).
        for b, (rid, _) in enumerate(order):
            st = self.requests[rid]
            if st.emit_prompt_logprobs:
                entries = self._prompt_logprobs(
                    st, hidden[qsl[b] : qsl[b + 1]], st.num_computed_tokens
                )
                if entries:
                    out.prompt_logprobs[rid] = entries

        # Requests whose chunk reaches the end of their known tokens (+ drafts) sample.
        sample_b = [
            b
            for b, (rid, _) in enumerate(order)
            if seq_lens[b] == len(self.requests[rid].token_ids) + len(drafts[b])
        ]
        for b, (rid, n) in enumerate(order):
            self.requests[rid].num_computed_tokens = starts[b] + n
            out.sampled_token_ids[rid] = []
        sampled_ok: set[str] = set()
        if sample_b:
            self._sample(so, order, sample_b, drafts, hidden, qsl, out, sampled_ok)
        if self.draft_model is not None:
            out.spec_token_ids = self._propose(order, starts, seq_lens, sampled_ok)
        return out

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
    ) -> None:
        """Score the last 1 + d rows of each sampling request, sample / verify, append tokens."""
        dev = self.device
        row_idx: list[int] = []
        spans: list[tuple[int, int]] = []  # (first logits row, 1 + d) per sampling request
        for b in sample_b:
            d = len(drafts[b])
            spans.append((len(row_idx), 1 + d))
            row_idx.extend(range(qsl[b + 1] - 1 - d, qsl[b + 1]))
        logits = self.model.compute_logits(hidden[torch.tensor(row_idx, device=dev)])  # [R, V]
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        good: list[int] = []  # indices into sample_b
        for j, b in enumerate(sample_b):
            r0, n = spans[j]
            if all(finite[r0 : r0 + n]):
                good.append(j)
            else:
                out.errors[order[b][0]] = (
                    "non-finite logits (NaN or inf) produced by the model for this request"
                )
        if not good:
            return
        keep = [r for j in good for r in range(spans[j][0], spans[j][0] + spans[j][1])]
        if len(keep) != len(row_idx):
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
            prompt, output = st.token_ids[: st.num_prompt_tokens], st.output_ids
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
            vres = self.sampler.verify(logits, rows, [drafts[sample_b[j]] for j in good])
            tokens, lps = vres.token_ids, vres.logprobs
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
