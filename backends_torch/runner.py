"""TorchModelRunner: the Torch backend's ModelRunner (CPU path; the GPU path builds on it).

Keeps per-request state (a persistent batch) keyed by request id, builds the flat ragged batch of
each step (input ids, positions, slot mapping, attention metadata), runs the model, and samples
for requests whose scheduled chunk reaches the end of their known tokens.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch
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
        self.block_size = config.cache.block_size
        default_attn = "torch_ref"
        self.attn_backend_name = os.environ.get("XLASERVE_ATTENTION_BACKEND", default_attn)
        self.attn_backend = get_attention_backend(self.attn_backend_name)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.requests: dict[str, _ReqState] = {}
        self.sampler = Sampler(self.device, seed=config.model.seed)

    # ---- setup ----------------------------------------------------------------------------

    def load_model(self) -> None:
        cls = get_model_class(self.spec.family)
        torch.manual_seed(self.config.model.seed)
        model = cls(self.spec, dtype=self.dtype, device=self.device, attn_backend=self.attn_backend)
        if self.config.load.load_format == "dummy":
            model.init_dummy_weights(seed=self.config.model.seed)
        else:
            from xlaserve.model_loader.registry import iter_canonical_weights

            model.load_weights(iter_canonical_weights(self.spec, self.config.load.load_format))
        self.model = model.eval()

    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.spec.kv_bytes_per_token(elem)

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
        self.model.compute_logits(hidden[-1:])

    def _alloc_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.spec.num_layers)
        ]

    def init_kv_cache(self, num_blocks: int) -> None:
        """Per layer K and V tensors [N, S, Hkv, D]."""
        self.num_blocks = num_blocks
        self.kv_caches = self._alloc_caches(num_blocks)

    def shutdown(self) -> None:
        self.kv_caches = []
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

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        so = scheduler_output
        if so.spec_token_ids and any(so.spec_token_ids.values()):
            raise NotImplementedError(
                "speculative decoding is not implemented in the torch runner yet"
            )
        if so.kv_copy_in or so.kv_copy_out:
            raise NotImplementedError(
                "KV offload copies are not implemented in the torch runner yet"
            )
        self._update_states(so)
        out = RunnerOutput()
        if not so.num_scheduled_tokens:
            return out
        assert self.model is not None, "load_model() must run before execute()"

        S = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        order = list(so.num_scheduled_tokens.items())
        for rid, n in order:
            st = self.requests[rid]
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            if end > len(st.token_ids):
                raise ValueError(
                    f"req {rid}: scheduled up to token {end} but only {len(st.token_ids)} tokens are known"
                )
            if math.ceil(end / S) > len(st.block_ids):
                raise ValueError(
                    f"req {rid}: {end} tokens need {math.ceil(end / S)} blocks, has {len(st.block_ids)}"
                )
            ids.extend(st.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(st.block_ids[p // S] * S + p % S for p in range(start, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            tables.append(st.block_ids)
        max_blocks = max(len(t) for t in tables)
        table = torch.zeros(len(tables), max_blocks, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        md = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            max_query_len=max(n for _, n in order),
            max_seq_len=max(seq_lens),
            query_start_loc_host=qsl,
            seq_lens_host=seq_lens,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
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

        # Requests whose chunk reaches the end of their known tokens sample one token.
        sample_b = [
            b
            for b, (rid, _) in enumerate(order)
            if seq_lens[b] == len(self.requests[rid].token_ids)
        ]
        for rid, n in order:
            st = self.requests[rid]
            st.num_computed_tokens += n
            out.sampled_token_ids[rid] = []
        if not sample_b:
            return out
        last_rows = torch.tensor([qsl[b + 1] - 1 for b in sample_b], device=dev)
        logits = self.model.compute_logits(hidden[last_rows])  # [Bs, V] float32
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        good = [j for j, ok in enumerate(finite) if ok]
        for j, ok in enumerate(finite):
            if not ok:
                rid = order[sample_b[j]][0]
                out.errors[rid] = (
                    "non-finite logits (NaN or inf) produced by the model for this request"
                )
        if not good:
            return out
        rows: list[SamplingRow] = []
        for j in good:
            rid = order[sample_b[j]][0]
            st = self.requests[rid]
            mask = so.grammar_bitmask.get(rid)
            rows.append(
                SamplingRow(
                    params=st.params,
                    prompt_ids=st.token_ids[: st.num_prompt_tokens],
                    output_ids=st.output_ids,
                    generator=st.generator,
                    bitmask=None if mask is None else mask.reshape(-1, mask.shape[-1])[0],
                )
            )
        sampled = self.sampler(logits[good] if len(good) != len(finite) else logits, rows)
        for k, j in enumerate(good):
            rid = order[sample_b[j]][0]
            tok = sampled.token_ids[k]
            self.requests[rid].token_ids.append(tok)
            out.sampled_token_ids[rid] = [tok]
            if sampled.logprobs[k] is not None:
                out.logprobs[rid] = [sampled.logprobs[k]]
        return out

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
