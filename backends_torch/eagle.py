"""EAGLE speculative decoding on the torch backend (method "eagle"; checkpoint format in
xlaserve.spec_decode.eagle).

The head is one decoder layer fed `fc([embed(token_p); feature_{p-1}])` (embedding and lm_head
are the target's); its entry at position p predicts the target's feature at p, whose lm_head
argmax drafts token p + 1. Each step, after the target's forward and sampling:

1. catch-up: the head computes its entries for the positions whose inputs became known this step
   (entries start+1 .. V, V = the last position whose token is known and whose previous position's
   target feature is verified: min(chunk end, len(tokens) - 1)); one batched forward over requests.
2. drafting: from the last entry's predicted feature, K - 1 more entries autoregressively (token =
   argmax of the previous prediction, feature = the previous prediction), batched over requests.
   Greedy requests get argmax drafts (deterministic: q one-hot in the rejection sampler); sampled
   requests draw drafts from q = softmax(head logits / temperature) with their own generator, and
   q goes to `Sampler.verify` (`draft_probs`), so verification stays lossless.

State: the head's own paged KV cache (one layer) indexed by the TARGET's block tables plus
scratch blocks per batch slot for draft positions past the request's blocks (the draft model's
scheme: draft.draft_table), stored as `runner.draft_kv_caches` so KV offload carries it. Its
KV at position p depends only on tokens 0..p, so it is as shareable as the target's: prefix-cache
hits reuse it. The one input a request starting at a prefix hit c > 0 (new, or resumed after
preemption) lacks is the feature of position c - 1; hits are whole blocks, so the runner keeps the
target feature of each block's last position per block id ([num_blocks, H], written whenever that
position is verified) and the entry at c reads it there. Chosen over recomputing a window: the
catch-up is then exact and costs one head row per new token.

Per request the head's progress is `st.extra["eagle_next"]` (next entry to compute), reset with the
runner's request state (new or resumed requests get a fresh state object).
"""

from __future__ import annotations

import torch
from torch import nn

from xlaserve.backends_torch.distributed.parallel_state import tp_world_size
from xlaserve.backends_torch.draft import draft_table
from xlaserve.backends_torch.layers.attention import AttentionBackend, AttentionMetadata
from xlaserve.backends_torch.models.base import CausalLMBase
from xlaserve.backends_torch.models.decoder import DecoderLayer
from xlaserve.config import KernelConfig
from xlaserve.model_loader.spec import ModelSpec
from xlaserve.runner_core import draft_quota
from xlaserve.spec_decode.eagle import build_eagle_spec

_NEXT = "eagle_next"
_Q = "eagle_q"  # (sampled drafts, q [K, V]) of the last proposal of a sampled request


class EagleHead(CausalLMBase):
    """fc [2H -> H] + one DecoderLayer. forward(emb [T, H], prev_feat [T, H], positions [T], kv,
    md) -> predicted features [T, H] (no final norm: they are lm_head inputs)."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device | str,
        attn_backend: AttentionBackend,
        kernels: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        h = spec.hidden_size
        build = kernels if kernels is not None else KernelConfig.from_env()
        self.fc = nn.Linear(2 * h, h, bias=True, dtype=dtype, device=device)
        self.layers = nn.ModuleList([DecoderLayer(spec, 0, attn_backend, dtype, device, build)])
        if kernels is not None:
            self.use_kernels(kernels)

    @torch.inference_mode()
    def forward(
        self,
        emb: torch.Tensor,
        prev_feat: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, ...]],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.fc(torch.cat([emb, prev_feat], dim=-1))
        delta, residual = self.layers[0](positions, x, None, kv_caches[0], md)
        return delta + residual


class EagleProposer:
    """The runner's EAGLE state: head module, its KV cache and the block-end feature store."""

    def __init__(self, runner: object, model_dir: str) -> None:
        from xlaserve.model_loader.resolve import resolve_model_dir

        if tp_world_size() > 1:
            raise NotImplementedError("speculative method 'eagle' runs without tensor parallelism")
        self.runner = runner
        path = resolve_model_dir(model_dir, None, runner.config.load.download_dir)
        self.spec = build_eagle_spec(path, runner.spec)  # ValueError on a mismatched head
        self.head: EagleHead | None = None
        self.feat: torch.Tensor | None = None  # [num_blocks, H]: feature of each block's last slot
        # Last step's (req ids, predicted features [B, H] that gave their first draft): for tests.
        self.last_features: tuple[list[str], torch.Tensor] | None = None

    def load(self) -> None:
        r = self.runner
        head = EagleHead(self.spec, r.dtype, r.device, r.attn_backend, r.config.kernels)
        if r.config.load.load_format == "dummy":
            head.init_dummy_weights(seed=r.config.model.seed + 2)
        else:
            from xlaserve.model_loader.weights import iter_safetensors

            head.load_weights(iter_safetensors(self.spec.model_dir))
        self.head = head.eval()

    def bytes_per_block(self, kv_bytes_per_token: int) -> int:
        """Device bytes per block id: the head's KV (kv_bytes_per_token of its spec per slot) and
        one feature row."""
        elem = self.runner.dtype.itemsize
        return self.runner.block_size * kv_bytes_per_token + self.spec.hidden_size * elem

    def init_cache(self, num_blocks: int) -> None:
        """Head KV: num_blocks + scratch blocks (draft.draft_table); the feature store."""
        r = self.runner
        scratch = r._draft_scratch * r._draft_slots
        r.draft_kv_caches = r._alloc_caches(num_blocks + scratch, self.spec)
        self.feat = torch.zeros(num_blocks, self.spec.hidden_size, dtype=r.dtype, device=r.device)

    @torch.inference_mode()
    def propose(
        self,
        order: list[tuple[str, int]],
        starts: list[int],
        ends: list[int],
        hidden: torch.Tensor,
        qsl: list[int],
        sampled_ok: set[str],
        errors: dict[str, str],
    ) -> dict[str, list[int]]:
        """Catch the head up on this step's verified tokens, then draft for sampled requests.

        order/starts/ends: the step's batch (req id, scheduled tokens), first and end positions
        of each chunk; hidden [T, H]: the target's features of the chunk rows (qsl offsets)."""
        r = self.runner
        assert self.head is not None and self.feat is not None
        S, dev, model = r.block_size, r.device, r.model
        chunks: list[tuple[list[int], int, list[int]]] = []
        feat_src: list[int] = []  # per catch-up row: hidden row, or -1 - k = special feature k
        specials: list[torch.Tensor] = []
        want: list[tuple[str, int, int]] = []  # (req id, chunk index, quota)
        store_blocks: list[int] = []
        store_rows: list[int] = []
        for b, (rid, _) in enumerate(order):
            if rid in errors:
                continue
            st = r.requests[rid]
            start, end = starts[b], ends[b]
            last = min(end, len(st.token_ids) - 1)  # V: the last entry computable now
            nxt = st.extra.get(_NEXT)
            if start == 0:
                lo = 0
            elif nxt is None or nxt <= start:
                lo = start  # first step of a (resumed) request after a prefix hit
            else:
                lo = start + 1
            # Block-end features verified this step (positions start .. last - 1).
            for q in range(start + S - 1 - start % S, last, S):
                store_blocks.append(st.block_ids[q // S])
                store_rows.append(qsl[b] + q - start)
            if last < lo:
                continue
            for p in range(lo, last + 1):
                if p == 0:
                    feat_src.append(-1 - len(specials))
                    specials.append(torch.zeros_like(self.feat[0]))
                elif p == start:  # feature of start - 1 from the store (hits are whole blocks)
                    feat_src.append(-1 - len(specials))
                    if start % S == 0:
                        specials.append(self.feat[st.block_ids[start // S - 1]])
                    else:  # not reachable with block-granular hits; a zero feature is safe
                        specials.append(torch.zeros_like(self.feat[0]))
                else:
                    feat_src.append(qsl[b] + p - 1 - start)
            st.extra[_NEXT] = last + 1
            st.extra.pop(_Q, None)
            chunks.append(
                (st.token_ids[lo : last + 1], lo, draft_table(r, st.block_ids, len(chunks)))
            )
            quota = draft_quota(st, r.num_spec_tokens, r.max_model_len) if rid in sampled_ok else 0
            if quota > 0:
                want.append((rid, len(chunks) - 1, quota))
        if store_blocks:
            self.feat[torch.tensor(store_blocks, device=dev)] = hidden[
                torch.tensor(store_rows, device=dev)
            ]
        if not chunks:
            return {}
        ids, pos, md = r._build_inputs(chunks)
        rows = torch.tensor([max(i, 0) for i in feat_src], device=dev)
        prev = hidden[rows]
        if specials:
            sp = [j for j, i in enumerate(feat_src) if i < 0]
            prev[torch.tensor(sp, device=dev)] = torch.stack(specials).to(prev.dtype)
        g = self.head(model.embed_tokens(ids), prev, pos, r.draft_kv_caches, md)
        if not want:
            return {}
        cqsl = md.query_start_loc_host
        g = g[torch.tensor([cqsl[c + 1] - 1 for _, c, _ in want], device=dev)]  # [B, H]
        self.last_features = ([rid for rid, _, _ in want], g)
        active = list(range(len(want)))
        states = [r.requests[rid] for rid, _, _ in want]
        q_rows: dict[int, list[torch.Tensor]] = {
            i: [] for i, st in enumerate(states) if not st.params.greedy
        }
        tok = self._pick(model.compute_logits(g), active, states, q_rows)
        proposals = {rid: [t] for (rid, _, _), t in zip(want, tok.tolist(), strict=True)}
        for step in range(1, max(q for _, _, q in want)):
            keep = [j for j, i in enumerate(active) if want[i][2] > step]
            if len(keep) != len(active):
                sel = torch.tensor(keep, device=dev)
                g, tok = g[sel], tok[sel]
                active = [active[j] for j in keep]
            step_chunks = [
                (
                    [proposals[want[i][0]][-1]],
                    len(r.requests[want[i][0]].token_ids) - 1 + step,
                    chunks[want[i][1]][2],
                )
                for i in active
            ]
            ids, pos, md = r._build_inputs(step_chunks)
            g = self.head(model.embed_tokens(tok), g, pos, r.draft_kv_caches, md)
            tok = self._pick(model.compute_logits(g), active, states, q_rows)
            for i, t in zip(active, tok.tolist(), strict=True):
                proposals[want[i][0]].append(t)
        for i, rows in q_rows.items():  # sampled drafts: what verification needs (q)
            states[i].extra[_Q] = (proposals[want[i][0]], torch.stack(rows))
        return proposals

    def _pick(
        self,
        logits: torch.Tensor,
        active: list[int],
        states: list,
        q_rows: dict[int, list[torch.Tensor]],
    ) -> torch.Tensor:
        """Draft tokens [B] from head logits [B, V]: argmax for greedy requests; for sampled ones
        a sample from q = softmax(logits / temperature) with the request's generator, q recorded
        in q_rows (the rejection sampler needs it to stay lossless)."""
        tok = logits.argmax(dim=-1)
        for j, i in enumerate(active):
            if i not in q_rows:
                continue
            st = states[i]
            q = torch.softmax(logits[j] / st.params.temperature, dim=-1)
            gen = st.generator if st.generator is not None else self.runner.sampler.generator
            tok[j] = torch.multinomial(q, 1, generator=gen)[0]
            q_rows[i].append(q)
        return tok

    def draft_probs(
        self, rids: list[str], drafts: list[list[int]]
    ) -> list[torch.Tensor | None] | None:
        """q [d, V] per request for verification (None = deterministic drafts: one-hot q); None
        when no request has sampled drafts. The scheduler may have cut the proposal short."""
        out: list[torch.Tensor | None] = []
        for rid, ds in zip(rids, drafts, strict=True):
            rec = self.runner.requests[rid].extra.get(_Q) if ds else None
            if rec is not None and rec[0][: len(ds)] != ds:
                raise ValueError(f"req {rid}: drafts {ds} are not the sampled proposal {rec[0]}")
            out.append(None if rec is None else rec[1][: len(ds)])
        return out if any(q is not None for q in out) else None
