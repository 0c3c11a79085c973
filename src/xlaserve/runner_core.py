"""The backend-neutral half of a model runner (numpy only; no torch or jax import).

Both backends' runners (backends_torch/runner.py, backends_xla/runner.py) subclass `RunnerCore`,
which owns everything that is bookkeeping rather than device work:

- the persistent batch: one `ReqState` per request id, created from `NewRequestData`, extended
  by `CachedRequestData` (new blocks; tokens the engine appended, e.g. jump-forward), dropped on `finished_req_ids` (`_update_states`);
- the step plan (`_plan_step`): for each scheduled request, the chunk of known tokens (+ drafts)
  it computes, whether it samples, and which input is still on the device (async scheduling:
  a `PENDING` last token, fed from the previous launch's tokens at row `pending_row`), with ONE
  set of validation errors;
- the ragged step inputs as numpy arrays (`ragged_inputs`: input ids, positions, slot mapping,
  block tables, query start locs, sequence lengths), which the backend copies to the device
  (padded to buckets on XLA);
- output assembly (`_accept`, `_fail`, `_defer_token`, `finish`) and the error messages that
  reach API clients (`NONFINITE_ERROR`).

A backend runner keeps only device work: numpy -> device arrays, forward, sample, CUDA graphs /
compiled programs. Its hooks: `_new_state(nr)` (the backend's per-request sampling state),
`_append_token(st, tok)` (host-side counts, if any) and, for async scheduling, `_read_pending`
and `_pending_logprobs` (read a launched step's tokens back).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import numpy as np

from xlaserve.runner import NewRequestData, RunnerOutput, SchedulerOutput, TokenLogprobs
from xlaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Placeholder token id (async scheduling): sampled by a launched step whose tokens have not
# reached the host yet; `finish` replaces it.
PENDING = -1
# The one message a request fails with when its logits hold NaN (or, where the backend checks
# it, +-inf); reaches API clients as the request's error.
NONFINITE_ERROR = "non-finite logits (NaN or inf) produced by the model for this request"


@dataclass
class ReqState:
    """One request of the persistent batch. Backends subclass it for their sampling state."""

    token_ids: list[int]  # prompt + output tokens known so far (PENDING while in flight)
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]  # KV block table, in order
    num_computed_tokens: int  # tokens whose KV is in the cache
    # Row of the last launch's token tensor holding this request's PENDING token.
    pending_row: int = -1
    # Prompt logprobs are emitted only on a request's first life (not again after preemption).
    emit_prompt_logprobs: bool = False
    # Recurrent-state slot (models with state-space layers; NewRequestData.state_slot), else -1.
    state_slot: int = -1

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class LaunchedStep:
    """A launched step (`launch`): its output so far and the requests whose PENDING token
    `finish` still has to fill in. Backends subclass it for the device values to read."""

    out: RunnerOutput
    # (request id, its state, index of its PENDING token, row of the step's token tensor).
    pending: list[tuple[str, ReqState, int, int]] = field(default_factory=list)


@dataclass
class StepPlan:
    """The scheduled requests of one step, in batch order (validated by `_plan_step`)."""

    req_ids: list[str] = field(default_factory=list)
    states: list[ReqState] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # first position computed this step
    counts: list[int] = field(default_factory=list)  # tokens computed this step
    drafts: list[list[int]] = field(default_factory=list)  # speculative drafts per request
    # Token ids computed this step per request: known[start : start + count].
    tokens: list[list[int]] = field(default_factory=list)
    # The chunk reaches the end of the known tokens (+ drafts): the request samples.
    sampling: list[bool] = field(default_factory=list)
    # Inputs still on the device (async scheduling): flat index in the step's tokens, and row of
    # the previous launch's token tensor, for each request whose last input is PENDING.
    feed_dst: list[int] = field(default_factory=list)
    feed_src: list[int] = field(default_factory=list)
    prompt_logprobs: bool = False  # some request emits prompt logprobs

    def chunks(self) -> list[tuple[list[int], int, list[int]]]:
        """(token ids, first position, block table) per request: `ragged_inputs`' argument."""
        return [
            (t, s, st.block_ids)
            for t, s, st in zip(self.tokens, self.starts, self.states, strict=True)
        ]


@dataclass
class RaggedInputs:
    """Host arrays of a ragged batch of B request chunks, T tokens in all (no padding)."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]: block_id * block_size + offset in the block
    block_tables: np.ndarray  # int32 [B, max blocks], zero-padded
    query_start_loc: np.ndarray  # int64 [B + 1]: chunk b is tokens [qsl[b], qsl[b + 1])
    seq_lens: np.ndarray  # int64 [B]: first position + chunk length
    max_query_len: int


def ragged_inputs(chunks: list[tuple[list[int], int, list[int]]], block_size: int) -> RaggedInputs:
    """chunks: per request (token ids to compute, position of the first, block table).
    Vectorised with numpy (no per-token Python work): one flat copy of the token ids and of the
    block tables, positions and slots by index arithmetic."""
    S = block_size
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
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    return RaggedInputs(ids, positions, slots, table, qsl, seq_lens, int(lens.max()))


def to_token_logprobs(
    ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, rows: range, k: int
) -> list[TokenLogprobs]:
    """TokenLogprobs of result rows `rows` from host arrays ids / logprobs [N, >= 1 + k] (entry
    0: the sampled or actual token, then the top k) and ranks [N]."""
    m = 1 + k
    return [
        TokenLogprobs(ids[j, :m].tolist(), logprobs[j, :m].tolist(), int(ranks[j])) for j in rows
    ]


def draft_quota(st: ReqState, num_spec_tokens: int, max_model_len: int) -> int:
    """Drafts worth proposing for a request: never past max_tokens or max_model_len (the bonus
    token of the verification step counts too)."""
    max_tokens = st.params.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - st.num_prompt_tokens
    left = min(max_tokens - st.num_output, max_model_len - len(st.token_ids))
    return max(0, min(num_spec_tokens, left - 1))


class RunnerCore:
    """The persistent batch and step bookkeeping shared by every backend runner.

    Subclasses set `block_size` and call `RunnerCore.__init__`; they implement `_new_state` and,
    for async scheduling (`launch` / `finish`), `_read_pending`."""

    block_size: int

    def __init__(self) -> None:
        self.requests: dict[str, ReqState] = {}

    # ---- persistent batch ---------------------------------------------------------------

    def _new_state(self, nr: NewRequestData) -> ReqState:
        """The state of a request seen for the first time (or resumed after preemption)."""
        raise NotImplementedError

    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's changes: forget finished requests, add new ones, extend tables."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for nr in so.new_requests:
            st = self.requests[nr.req_id] = self._new_state(nr)
            st.state_slot = nr.state_slot
        for cr in so.cached_requests:
            st = self.requests.get(cr.req_id)
            if st is None:
                raise KeyError(
                    f"cached request {cr.req_id!r} is unknown to the runner (never sent as new)"
                )
            st.block_ids.extend(cr.new_block_ids)
            for tok in cr.new_token_ids:  # forced by a grammar (jump-forward), not sampled here
                self._append_token(st, tok)
            if cr.num_computed_tokens != st.num_computed_tokens:
                # The scheduler is the source of truth (e.g. after rejected drafts).
                logger.debug(
                    "req %s: num_computed %d -> %d",
                    cr.req_id,
                    st.num_computed_tokens,
                    cr.num_computed_tokens,
                )
                st.num_computed_tokens = cr.num_computed_tokens

    @staticmethod
    def _check_drafts(so: SchedulerOutput) -> None:
        stray = [r for r, d in so.spec_token_ids.items() if d and r not in so.num_scheduled_tokens]
        if stray:
            raise ValueError(f"speculative drafts for requests not scheduled this step: {stray}")

    def _plan_step(
        self,
        so: SchedulerOutput,
        max_drafts: int | None = None,
        max_blocks: int | None = None,
        max_seqs: int | None = None,
    ) -> StepPlan:
        """Validate the step's scheduled chunks against the persistent batch; the limits (None =
        unchecked) are a backend's fixed shapes: drafts per request, blocks per request (with
        max_model_len), requests per step."""
        S = self.block_size
        spec = so.spec_token_ids
        plan = StepPlan()
        if max_seqs is not None and len(so.num_scheduled_tokens) > max_seqs:
            raise ValueError(
                f"{len(so.num_scheduled_tokens)} requests in one step exceed max_num_seqs {max_seqs}"
            )
        t_off = 0
        for rid, n in so.num_scheduled_tokens.items():
            st = self.requests[rid]
            ds = list(spec[rid]) if rid in spec else []
            if max_drafts is not None and len(ds) > max_drafts:
                raise ValueError(
                    f"req {rid}: {len(ds)} drafts exceed num_speculative_tokens {max_drafts}"
                )
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
            nblk = len(st.block_ids)
            if -(-end // S) > nblk or (max_blocks is not None and nblk > max_blocks):
                raise ValueError(
                    f"req {rid}: {nblk} blocks cannot hold {end} tokens "
                    f"({-(-end // S)} needed; at most {max_blocks} per request)"
                )
            if known[end - 1] == PENDING:  # sampled by the launch still in flight
                plan.feed_dst.append(t_off + n - 1)
                plan.feed_src.append(st.pending_row)
            t_off += n
            plan.req_ids.append(rid)
            plan.states.append(st)
            plan.starts.append(start)
            plan.counts.append(n)
            plan.drafts.append(ds)
            plan.tokens.append(known[start:end])
            plan.sampling.append(end == len(known))
            plan.prompt_logprobs = plan.prompt_logprobs or st.emit_prompt_logprobs
        return plan

    # ---- outputs ------------------------------------------------------------------------

    def _append_token(self, st: ReqState, tok: int) -> None:
        """Append a sampled token to the request (backends with host-side counts override)."""
        st.token_ids.append(tok)

    def _accept(self, out: RunnerOutput, rid: str, st: ReqState, tokens: list[int]) -> None:
        """Record a request's sampled tokens (one, or the accepted drafts + one)."""
        for tok in tokens:
            self._append_token(st, tok)
        # KV is valid up to the last accepted token; the new last token is computed next.
        st.num_computed_tokens = len(st.token_ids) - 1
        out.sampled_token_ids[rid] = tokens

    @staticmethod
    def _fail(out: RunnerOutput, rid: str) -> None:
        """The request's logits were not finite: it fails alone, the batch goes on."""
        out.errors[rid] = NONFINITE_ERROR

    @staticmethod
    def _defer_token(launched: LaunchedStep, rid: str, st: ReqState, row: int) -> None:
        """A token sampled on the device and not read yet: a PENDING placeholder (row `row` of
        the launch's tokens), which the next launch feeds on the device and `finish` fills."""
        launched.pending.append((rid, st, len(st.token_ids), row))
        st.token_ids.append(PENDING)
        st.num_computed_tokens = len(st.token_ids) - 1
        st.pending_row = row

    # ---- async scheduling ---------------------------------------------------------------

    def _read_pending(self, launched: LaunchedStep) -> tuple[list[int], set[int]]:
        """Wait for a launched step's tokens: (token per row, rows whose logits were not finite)."""
        raise NotImplementedError

    def _pending_logprobs(
        self, launched: LaunchedStep, st: ReqState, row: int
    ) -> list[TokenLogprobs] | None:
        """Logprobs of a deferred token (None: the request did not ask, or none are kept)."""
        return None

    def finish(self, launched: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's tokens; fill its PENDING placeholders."""
        out = launched.out
        if not launched.pending:
            return out
        tokens, bad = self._read_pending(launched)
        for rid, st, idx, row in launched.pending:
            if row in bad:
                self._fail(out, rid)
                continue
            tok = tokens[row]
            if self.requests.get(rid) is st:  # else finished/preempted since: nothing to fill
                st.token_ids[idx] = tok
            out.sampled_token_ids[rid] = [tok]
            lps = self._pending_logprobs(launched, st, row)
            if lps is not None:
                out.logprobs[rid] = lps
        launched.pending = []
        return out
