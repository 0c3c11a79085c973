"""On-device sampling implementing SamplingParams in the order its docstring fixes:

1. logit_bias (added); min_tokens (stop/EOS ids -> -inf while fewer outputs than min_tokens);
   bad_words, allowed_token_ids, logits_processors; structured-output bitmask (disallowed -> -inf)
2. repetition_penalty (prompt + output tokens), frequency_penalty, presence_penalty (output tokens)
3. greedy argmax when temperature == 0; else / temperature, top_k, top_p, min_p, then sample with
   the request's generator (seeded per request when `seed` is set, else the sampler's generator).
Logprobs come from log_softmax of the RAW logits. Vectorized over the batch [B, V].

Sampling uses the exponential-race trick (argmax(p / q), q ~ Exp(1)) so each request draws from
its own generator without a device sync.

`Sampler.verify` implements the speculative-decoding verification contract of
`xlaserve.spec_decode.rejection` (greedy acceptance, lossless rejection sampling) on the same
processing steps, one row per scored position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from xlaserve.runner import TokenLogprobs
from xlaserve.runner_core import ReqState
from xlaserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One request to sample this step."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # tokens generated so far (before this step's token)
    generator: torch.Generator | None = None  # per-request (seeded) generator; None = shared
    bitmask: np.ndarray | None = None  # packed allowed-token bits int32 [ceil(V / 32)]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [B]
    logprobs: list[TokenLogprobs | None]  # [B]; None where the request did not ask


def is_plain_greedy(params: SamplingParams) -> bool:
    """True when a request's token is always the argmax of its raw logits (greedy, no
    logit_bias, no penalties, no logprobs). min_tokens and bitmasks are per step: see
    `argmax_only_step`."""
    return (
        params.greedy
        and not params.logit_bias
        and not params.has_token_constraints
        and not params.needs_penalties
        and params.logprobs is None
    )


def stop_mask_until(params: SamplingParams) -> int:
    """The output length below which min_tokens masks the stop tokens (0: never), i.e.
    `params.masks_stop_tokens(n)` == (n < stop_mask_until(params)), for callers that cache it."""
    return params.min_tokens if params.all_stop_token_ids() else 0


def defer_ok(params: SamplingParams) -> bool:
    """`deferrable_step`'s per-request part (no penalties, logit_bias, token constraints or
    logprobs), for callers that cache it."""
    p = params
    return not (
        p.needs_penalties or p.logit_bias or p.has_token_constraints or p.logprobs is not None
    )


def argmax_only_step(
    params: SamplingParams, plain_greedy: bool, num_output: int, has_bitmask: bool
) -> bool:
    """True when this step's token is the argmax of the raw logits: a plain greedy request
    (`plain_greedy` = is_plain_greedy(params), cached by callers) with no bitmask this step and no
    min_tokens stop masking active (`num_output` tokens generated so far)."""
    return plain_greedy and not has_bitmask and not params.masks_stop_tokens(num_output)


def deferrable_step(params: SamplingParams, num_output: int, has_bitmask: bool) -> bool:
    """True when this step's token needs no host data and no host sync to sample (async
    scheduling): no bitmask, penalties, logit_bias, logprobs or active min_tokens masking;
    greedy or temperature / top_k / top_p / min_p sampling."""
    # (bad_words / logits processors, the token constraints, read the output tokens.)
    return not (has_bitmask or params.masks_stop_tokens(num_output)) and defer_ok(params)


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


class PinnedRing:
    """Preallocated pinned host buffers for small non-blocking copies, used round-robin. A slot
    is reused only after the copy that last used it has finished (its event), and nothing is
    allocated per step: allocating pinned memory (cudaHostAlloc) can synchronize the device,
    which would undo async scheduling."""

    def __init__(self, slots: int, nbytes: int) -> None:
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.i = 0

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int] | None:
        """A pinned [numel] view of the next slot and its index (None when it is too small)."""
        k = self.i % len(self.bufs)
        nbytes = numel * dtype.itemsize
        if nbytes > self.bufs[k].numel():
            return None
        self.i += 1
        if self.events[k] is not None:
            self.events[k].synchronize()  # long done: the slot was used len(bufs) copies ago
        return self.bufs[k][:nbytes].view(dtype), k

    def record(self, k: int) -> torch.cuda.Event:
        """Mark slot k in use by the copy just enqueued on the current stream."""
        ev = torch.cuda.Event()
        ev.record()
        self.events[k] = ev
        return ev


_STAGING: dict[torch.device, PinnedRing] = {}


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the stream: through a preallocated
    pinned buffer and a non-blocking copy on CUDA (a pageable copy would synchronize with the
    queued kernels)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    ring = _STAGING.get(device)
    if ring is None:
        ring = _STAGING[device] = PinnedRing(slots=64, nbytes=1 << 16)
    slot = ring.take(len(values), dtype)
    if slot is None:  # larger than a slot (rare): a one-off pinned copy
        return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
    host, k = slot
    host.copy_(torch.tensor(values, dtype=dtype))
    out = host.to(device, non_blocking=True)
    ring.record(k)
    return out


def argmax_only(row: SamplingRow) -> bool:
    """`argmax_only_step` for a SamplingRow."""
    return argmax_only_step(
        row.params, is_plain_greedy(row.params), len(row.output_ids), row.bitmask is not None
    )


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 [B, W] (bit i of word w allows token 32 w + i) -> bool allowed [B, V]."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32)[:, :, None] >> shifts) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _token_counts(rows_tokens: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Occurrence counts [B, V] int32 of each row's token list."""
    longest = max((len(t) for t in rows_tokens), default=0)
    if longest == 0:
        return torch.zeros(len(rows_tokens), vocab, dtype=torch.int32, device=device)
    padded = torch.full((len(rows_tokens), longest), vocab, dtype=torch.long)
    for i, toks in enumerate(rows_tokens):
        if toks:
            padded[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    padded = padded.to(device)
    counts = torch.zeros(len(rows_tokens), vocab + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab]


def apply_constraints(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Step 1: logit_bias, min_tokens, bitmask. logits [B, V] float32 (modified in place)."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            ids = [t for t in p.logit_bias if 0 <= t < vocab]
            if ids:
                bias = torch.tensor([p.logit_bias[t] for t in ids], dtype=logits.dtype)
                logits[i, ids] += bias.to(logits.device)
        if p.min_tokens and len(r.output_ids) < p.min_tokens:
            stop = [t for t in p.all_stop_token_ids() if 0 <= t < vocab]
            if stop:
                logits[i, stop] = float("-inf")
        if p.has_token_constraints:  # bad_words, allowed_token_ids, logits_processors
            banned = [t for t in p.banned_token_ids(r.output_ids) if 0 <= t < vocab]
            if banned:
                logits[i, banned] = float("-inf")
            off = p.disallowed_mask(vocab)
            if off is not None:
                logits[i].masked_fill_(torch.from_numpy(off).to(logits.device), float("-inf"))
            if p.logits_processors:
                row = p.run_logits_processors(r.prompt_ids, r.output_ids, logits[i].clone())
                logits[i] = row.to(logits.dtype)
    masked = [i for i, r in enumerate(rows) if r.bitmask is not None]
    if masked:
        # One packed [B, W] array (all bits set = any token for unmasked rows), one unpack and
        # ONE in-place masked_fill over the whole batch (no gather / scatter of masked rows).
        words = (vocab + 31) // 32
        packed = np.full((len(rows), words), -1, dtype="<i4")
        for i in masked:
            packed[i] = np.asarray(rows[i].bitmask, dtype=np.int32).reshape(-1)[:words]
        logits.masked_fill_(forbidden_tokens(packed, vocab, logits.device), float("-inf"))
    return logits


def forbidden_tokens(packed: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """Packed little-endian int32 [B, W] -> bool [B, V], True where the token is NOT allowed.
    On the CPU numpy unpacks the bytes directly (the bit order of an int32 read as 4
    little-endian bytes is the token order); elsewhere the unpack runs on the device."""
    if device.type == "cpu":
        bits = np.unpackbits((~packed).view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(bits.view(bool))
    return ~unpack_bitmask(torch.from_numpy(packed).to(device), vocab)


def forbidden_from_bytes(packed_bytes: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed bitmask rows as bytes, uint8 [B, 4 W] (the little-endian int32 words' bytes), on
    any device -> bool [B, V], True where the token is NOT allowed. Bit j of byte m is token
    8 m + j; unpacking uint8 moves a quarter of the bytes of an int32 unpack ([256, 128k]:
    32 MB, not 128 MB)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed_bytes.device)
    bits = (packed_bytes[:, :, None] >> shifts) & 1  # [B, 4 W, 8]
    return bits.view(packed_bytes.shape[0], -1)[:, :vocab] == 0


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Step 2: repetition (prompt + output), frequency and presence (output) penalties, in place."""
    sel = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not sel:
        return logits
    vocab, dev = logits.shape[1], logits.device
    out_counts = _token_counts([rows[i].output_ids for i in sel], vocab, dev).to(logits.dtype)
    prompt_seen = _token_counts([rows[i].prompt_ids for i in sel], vocab, dev) > 0
    rep = torch.tensor(
        [rows[i].params.repetition_penalty for i in sel], dtype=logits.dtype, device=dev
    )[:, None]
    freq = torch.tensor(
        [rows[i].params.frequency_penalty for i in sel], dtype=logits.dtype, device=dev
    )[:, None]
    pres = torch.tensor(
        [rows[i].params.presence_penalty for i in sel], dtype=logits.dtype, device=dev
    )[:, None]
    idx = torch.tensor(sel, device=dev)
    x = logits[idx]
    seen = prompt_seen | (out_counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * out_counts - pres * (out_counts > 0).to(x.dtype)
    logits[idx] = x
    return logits


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Step 3 (non-greedy rows): / temperature, then top_k, top_p, min_p masks (-inf). [B, V]."""
    dev, vocab = logits.device, logits.shape[1]
    temps = [max(p.temperature, 1e-5) for p in params]
    if any(t != 1.0 for t in temps):  # x / 1.0 == x: skip a [B, V] op at temperature 1
        logits = logits / to_device(temps, logits.dtype, dev)[:, None]
    need_k = any(p.top_k > 0 for p in params)
    need_p = any(p.top_p < 1.0 for p in params)
    need_min_p = any(p.min_p > 0.0 for p in params)
    if not (need_k or need_p or need_min_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_k:
        k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.long, dev)[:, None]
        drop |= rank >= k
    if need_p:
        top_p = to_device([p.top_p for p in params], logits.dtype, dev)[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        # Keep the smallest prefix reaching top_p (the best token is always kept).
        drop |= (before >= top_p) & (top_p < 1.0) & (rank > 0)
    if need_min_p:
        min_p = to_device([p.min_p for p in params], logits.dtype, dev)[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        drop |= probs < min_p * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[TokenLogprobs]:
    """Per row: the given token's logprob and rank, then the top-`num_top[i]` tokens.

    logprobs [B, V] (log_softmax of raw logits), token_ids [B]."""
    k = max(num_top, default=0)
    chosen = logprobs.gather(1, token_ids[:, None].long())  # [B, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_v, top_i = logprobs.topk(k, dim=1) if k > 0 else (None, None)
    chosen_l, ranks_l, ids_l = chosen[:, 0].tolist(), ranks.tolist(), token_ids.tolist()
    top_v_l = top_v.tolist() if top_v is not None else None
    top_i_l = top_i.tolist() if top_i is not None else None
    out = []
    for i, n in enumerate(num_top):
        ids, lps = [int(ids_l[i])], [float(chosen_l[i])]
        if n > 0:
            ids += top_i_l[i][:n]
            lps += top_v_l[i][:n]
        out.append(TokenLogprobs(token_ids=ids, logprobs=lps, rank=int(ranks_l[i])))
    return out


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # [B][1..d_b + 1]: accepted drafts + the bonus/recovered token
    logprobs: list[list[TokenLogprobs] | None]  # [B]; one entry per returned token


class Sampler:
    """Samples one token per row of a [B, V] logits tensor."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        # Shared generator for requests without a seed (engine-level seed: reproducible runs).
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        """The per-request generator of a seeded request (created once, advanced every step)."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], owned: bool = False
    ) -> SamplerOutput:
        """logits [B, V] float32 raw model logits: not modified, unless `owned` (the caller
        drops them after this call), when the constraints are applied in place instead of on a
        copy ([256, 128k] float32 is 131 MB: a 27 ms copy a step on a 2-core host)."""
        b, vocab = logits.shape
        if b != len(rows):
            raise ValueError(f"logits have {b} rows but {len(rows)} sampling rows were given")
        # Fast path: argmax-only rows need no copy, constraints or per-row tensors; when some
        # rows are, the full path runs on the others only (same tokens: the shared generator
        # draws for non-greedy rows only, and every step is row-wise).
        plain = [argmax_only(r) for r in rows]
        if all(plain):
            return SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=[None] * b)
        if any(plain):
            rest = [i for i in range(b) if not plain[i]]
            sub = self(  # the gathered rows are a new tensor of this call's own
                logits[torch.tensor(rest, device=logits.device)], [rows[i] for i in rest], True
            )
            token_ids = logits.argmax(dim=-1).tolist()
            lps_all: list[TokenLogprobs | None] = [None] * b
            for j, i in enumerate(rest):
                token_ids[i], lps_all[i] = sub.token_ids[j], sub.logprobs[j]
            return SamplerOutput(token_ids=token_ids, logprobs=lps_all)
        want_lp = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if any(want_lp) else None
        x = logits.float()  # a copy unless logits are float32 already
        x = apply_constraints(x if owned or x is not logits else x.clone(), rows)
        x = apply_penalties(x, rows)
        tokens = self._draw(x, rows)
        token_list = tokens.tolist()
        lps: list[TokenLogprobs | None] = [None] * b
        sel = [i for i in range(b) if want_lp[i]]
        if sel:
            idx = torch.tensor(sel, device=logits.device)
            entries = token_logprobs(
                raw_logprobs[idx], tokens[idx], [rows[i].params.logprobs for i in sel]
            )
            for i, e in zip(sel, entries, strict=True):
                lps[i] = e
        return SamplerOutput(token_ids=[int(t) for t in token_list], logprobs=lps)

    def sample_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Tokens [B] (int64, on the device) without any host sync, for rows that are all
        `deferrable_step` (their constraints and penalties are no-ops); same tokens as
        `__call__` with the same generator state."""
        if all(r.params.greedy for r in rows):
            return logits.argmax(dim=-1)
        return self._draw(logits.float(), rows)

    def _draw(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Step 3 on processed logits x [B, V]: argmax for greedy rows, the exponential race
        over the filtered distribution for the others. Returns tokens [B] on the device."""
        b, vocab = x.shape
        rand_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        every = len(rand_rows) == b  # every row samples: no argmax, gather or scatter of rows
        tokens = None if every else x.argmax(dim=-1)  # greedy rows keep this
        if not rand_rows:
            return tokens
        idx = None if every else to_device(rand_rows, torch.long, x.device)
        filtered = filter_logits(x if every else x[idx], [rows[i].params for i in rand_rows])
        probs = torch.softmax(filtered, dim=-1)
        shared = [j for j, i in enumerate(rand_rows) if rows[i].generator is None]
        if len(shared) == len(rand_rows):  # the same draws as filling q[shared] below
            q = torch.empty(len(shared), vocab, device=x.device).exponential_(
                generator=self.generator
            )
        else:
            q = torch.empty(len(rand_rows), vocab, dtype=torch.float32, device=x.device)
            if shared:
                q[to_device(shared, torch.long, x.device)] = torch.empty(
                    len(shared), vocab, device=x.device
                ).exponential_(generator=self.generator)
        for j, i in enumerate(rand_rows):
            if rows[i].generator is not None:
                q[j].exponential_(generator=rows[i].generator)
        drawn = (probs / q.clamp_min(1e-20)).argmax(dim=-1)
        if every:
            return drawn
        tokens[idx] = drawn
        return tokens

    def _race(self, probs: torch.Tensor, generator: torch.Generator | None) -> int:
        """One sample from probs [V] by the exponential race with the row's generator."""
        q = torch.empty_like(probs, dtype=torch.float32).exponential_(
            generator=generator if generator is not None else self.generator
        )
        return int((probs / q.clamp_min(1e-20)).argmax())

    def verify(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        drafts: list[list[int]],
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> VerifyOutput:
        """Speculative verification (see xlaserve.spec_decode.rejection for the contract).

        logits [R, V] float32 raw; request b owns 1 + len(drafts[b]) consecutive rows, and its
        row i (a SamplingRow whose output_ids already end with drafts[b][:i], and whose bitmask
        is the grammar row for position i) predicts the token after drafts[b][:i].
        draft_probs[b]: [d_b, V] draft distributions, or None = deterministic (one-hot) drafts.
        A request with no drafts is sampled exactly like `__call__` does it.
        """
        r_total, vocab = logits.shape
        spans = [1 + len(d) for d in drafts]
        if sum(spans) != r_total or len(rows) != r_total:
            raise ValueError(f"{r_total} logits rows / {len(rows)} sampling rows for spans {spans}")
        x = apply_constraints(logits.float().clone(), rows)
        x = apply_penalties(x, rows)
        argmax = x.argmax(dim=-1).tolist()  # [R]
        rand_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        probs = torch.empty(0)
        pos_of = {}
        if rand_rows:
            idx = torch.tensor(rand_rows, device=x.device)
            filtered = filter_logits(x[idx], [rows[i].params for i in rand_rows])
            probs = torch.softmax(filtered, dim=-1)  # [Rr, V]
            pos_of = {i: j for j, i in enumerate(rand_rows)}
        tokens: list[list[int]] = []
        start = 0
        for b, ds in enumerate(drafts):
            row = rows[start]
            out: list[int] = []
            if row.params.greedy:
                for i, t in enumerate(ds):
                    if argmax[start + i] != t:
                        break
                    out.append(t)
                out.append(argmax[start + len(out)])
            else:
                gen = row.generator if row.generator is not None else self.generator
                q = None if draft_probs is None else draft_probs[b]
                p_rows = probs[[pos_of[start + i] for i in range(len(ds) + 1)]]  # [1 + d, V]
                if ds:
                    u = torch.rand(len(ds), generator=gen, device=x.device)
                    d_ids = torch.tensor(ds, device=x.device)
                    p_x = p_rows[:-1].gather(1, d_ids[:, None])[:, 0]
                    q_x = torch.ones_like(p_x) if q is None else q.gather(1, d_ids[:, None])[:, 0]
                    accept = (u * q_x < p_x).tolist()  # u < p(x) / q(x)
                    k = accept.index(False) if False in accept else len(ds)
                else:
                    k = 0
                out = list(ds[:k])
                if k < len(ds):  # rejected: sample from norm(max(0, p - q))
                    resid = p_rows[k].clone()
                    if q is None:
                        resid[ds[k]] = 0.0
                    else:
                        resid = (resid - q[k]).clamp_min(0.0)
                    if float(resid.sum()) <= 0.0:
                        resid = p_rows[k]
                    out.append(self._race(resid / resid.sum(), gen))
                else:
                    out.append(self._race(p_rows[k], gen))
            tokens.append(out)
            start += spans[b]
        lps: list[list[TokenLogprobs] | None] = [None] * len(drafts)
        want = [b for b in range(len(drafts)) if rows[sum(spans[:b])].params.logprobs is not None]
        if want:
            raw = torch.log_softmax(logits.float(), dim=-1)
            starts = np.cumsum([0] + spans[:-1]).tolist()
            sel_rows, sel_tok, tops = [], [], []
            for b in want:
                n = rows[starts[b]].params.logprobs
                for i, t in enumerate(tokens[b]):
                    sel_rows.append(starts[b] + i)
                    sel_tok.append(t)
                    tops.append(n)
            entries = token_logprobs(
                raw[torch.tensor(sel_rows, device=raw.device)],
                torch.tensor(sel_tok, device=raw.device),
                tops,
            )
            pos = 0
            for b in want:
                lps[b] = entries[pos : pos + len(tokens[b])]
                pos += len(tokens[b])
        return VerifyOutput(token_ids=tokens, logprobs=lps)


def sample_requests(
    sampler: Sampler,
    logits: torch.Tensor,
    req_ids: list[str],
    states: list[ReqState],
    drafts: list[list[int]],
    bitmasks: dict,
    q: torch.Tensor | None = None,
    owned: bool = False,
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """Sample (no drafts anywhere) or verify (Sampler.verify, draft distributions q or one-hot)
    the requests whose 1 + d rows are `logits` [sum(1 + d), V], in order. states: the runner's
    per-request states (runner_core.ReqState + generator); bitmasks: req_id -> i32
    [positions, W] (SchedulerOutput.grammar_bitmask); owned: the caller drops logits after
    this call (the sampler may modify them, `Sampler.__call__`). Returns tokens and logprobs
    per request."""
    rows: list[SamplingRow] = []
    for rid, st, ds in zip(req_ids, states, drafts, strict=True):
        mask = bitmasks.get(rid)
        if mask is not None:
            mask = mask.reshape(-1, mask.shape[-1])
            if mask.shape[0] < 1 + len(ds):
                raise ValueError(
                    f"req {rid}: grammar bitmask has {mask.shape[0]} rows for {1 + len(ds)} "
                    "scored positions (need one row per position)"
                )
        # The sampler reads prompt/output tokens only for penalties and logits processors
        # (output: also for min_tokens and bad_words): skip the copies otherwise.
        p = st.params
        procs = bool(p.logits_processors)
        prompt = st.token_ids[: st.num_prompt_tokens] if p.needs_penalties or procs else []
        history = p.needs_penalties or p.min_tokens or p.has_token_constraints
        output = st.output_ids if history else []
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
    if not any(drafts):
        res = sampler(logits, rows, owned=owned)
        return [[t] for t in res.token_ids], [None if e is None else [e] for e in res.logprobs]
    vres = sampler.verify(logits, rows, drafts, q)
    return vres.token_ids, vres.logprobs


def prompt_logprobs(
    model: torch.nn.Module, st: ReqState, hidden: torch.Tensor, start: int
) -> list[TokenLogprobs]:
    """Rows of `hidden` [n, H] are positions start..start+n-1; row j predicts token j + 1.
    Returns entries for prompt positions p = start+1 .. min(start+n, P-1) in order."""
    num_prompt = st.num_prompt_tokens
    n = min(hidden.shape[0], num_prompt - 1 - start)
    if n <= 0:
        return []
    logits = model.compute_logits(hidden[:n])
    lp = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(st.token_ids[start + 1 : start + 1 + n], device=lp.device)
    return token_logprobs(lp, targets, [st.params.prompt_logprobs] * n)
