"""Draft-model speculative decoding on the torch backend (`speculative_config.method="draft_model"`).

A second, small model (same tokenizer, vocabulary no larger than the target's) runs inside
`TorchModelRunner` with its own paged KV cache (`runner.draft_kv_caches`) indexed by the SAME
block tables (same num_blocks, plus a few scratch blocks per batch slot for proposal positions
past the request's allocated blocks: `draft_table`). Each step it catches up on the step's
verified tokens (writing its KV where the target wrote its own) and then proposes K tokens
greedily (deterministic drafts: q is one-hot in the rejection sampler).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from xlaserve.backends_torch.distributed.parallel_state import tp_world_size
from xlaserve.backends_torch.models import get_model_class
from xlaserve.config import EngineConfig
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.runner_core import draft_quota

if TYPE_CHECKING:
    from xlaserve.backends_torch.runner import TorchModelRunner


def draft_table(runner: TorchModelRunner, block_ids: list[int], slot: int) -> list[int]:
    """The request's block table + its batch slot's scratch blocks (draft / EAGLE cache only)."""
    if slot >= runner._draft_slots:
        raise ValueError(f"draft batch slot {slot} >= max_num_seqs {runner._draft_slots}")
    base = runner.num_blocks + slot * runner._draft_scratch
    return block_ids + list(range(base, base + runner._draft_scratch))


def draft_model_spec(config: EngineConfig, spec: ModelSpec) -> ModelSpec:
    """The draft model's spec; ValueError when it cannot share the target's tokenizer."""
    from xlaserve.model_loader.registry import build_spec
    from xlaserve.model_loader.resolve import resolve_model_dir

    sc = config.speculative
    draft_spec = build_spec(resolve_model_dir(sc.model, None, config.load.download_dir))
    if draft_spec.vocab_size > spec.vocab_size:
        raise ValueError(
            f"draft model vocab ({draft_spec.vocab_size}) is larger than the target's "
            f"({spec.vocab_size}): the draft must share the target's tokenizer"
        )
    return draft_spec


def load_draft_model(runner: TorchModelRunner) -> torch.nn.Module:
    """The draft module with its weights (dummy or the checkpoint's; this rank's TP shard)."""
    cfg, draft_spec = runner.config, runner.draft_spec
    dcls = get_model_class(draft_spec.family)
    draft = dcls(draft_spec, dtype=runner.dtype, device=runner.device,
                 attn_backend=runner.attn_backend, kernels=runner.kernels)  # fmt: skip
    if cfg.load.load_format == "dummy":
        draft.init_dummy_weights(seed=cfg.model.seed + 1)
    else:
        from xlaserve.model_loader.registry import iter_canonical_weights

        dw = iter_canonical_weights(draft_spec, cfg.load.load_format)
        if tp_world_size() > 1:
            from xlaserve.backends_torch.distributed.layers import tp_weight_stream

            dw = tp_weight_stream(draft, dw)
        draft.load_weights(dw)
    return draft.eval()


def propose(
    r: TorchModelRunner,
    order: list[tuple[str, int]],
    starts: list[int],
    ends: list[int],
    sampled_ok: set[str],
) -> dict[str, list[int]]:
    """Catch the draft model up on this step's verified tokens, then propose greedily."""
    assert r.draft_model is not None
    chunks: list[tuple[list[int], int, list[int]]] = []
    want: list[tuple[str, int, int]] = []  # (req id, chunk index, quota)
    for b, (rid, _) in enumerate(order):
        st = r.requests[rid]
        stop = len(st.token_ids) if rid in sampled_ok else min(ends[b], len(st.token_ids))
        toks = st.token_ids[starts[b] : stop]
        if not toks:
            continue
        chunks.append((toks, starts[b], draft_table(r, st.block_ids, len(chunks))))
        quota = draft_quota(st, r.num_spec_tokens, r.max_model_len) if rid in sampled_ok else 0
        if quota > 0:
            want.append((rid, len(chunks) - 1, quota))
    if not chunks:
        return {}
    ids, pos, md = r._build_inputs(chunks)
    hidden = r.draft_model(ids, pos, r.draft_kv_caches, md)
    if not want:
        return {}
    qsl = md.query_start_loc_host
    last = torch.tensor([qsl[c + 1] - 1 for _, c, _ in want], device=r.device)
    nxt = r.draft_model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
    proposals = {rid: [t] for (rid, _, _), t in zip(want, nxt, strict=True)}
    for step in range(1, max(q for _, _, q in want)):
        active = [(rid, c) for rid, c, q in want if q > step]
        step_chunks = [
            (
                [proposals[rid][-1]],
                len(r.requests[rid].token_ids) - 1 + step,
                chunks[c][2],
            )
            for rid, c in active
        ]
        ids, pos, md = r._build_inputs(step_chunks)
        hidden = r.draft_model(ids, pos, r.draft_kv_caches, md)
        nxt = r.draft_model.compute_logits(hidden).argmax(dim=-1).tolist()
        for (rid, _), t in zip(active, nxt, strict=True):
            proposals[rid].append(t)
    return proposals
