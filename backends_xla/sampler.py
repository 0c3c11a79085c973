"""On-device sampling with the full SamplingParams semantics (order: sampling_params.py docstring).

All per-request parameters of a step are batched into padded arrays (`SamplingTensors`, rows =
the request bucket B), so ONE jitted program serves a bucket whatever the step asks for: the
dense inputs (`bias`, `bitmask`, `output_counts`, `prompt_mask`) are always present (a step that
needs none of them passes device-resident neutral arrays, so nothing is copied), and runtime
`lax.cond`s skip the work nobody asked for: the dense extras (`use_extras`), the top-k/top-p/min-p
filter and Gumbel noise (only when some row has temperature > 0) and the logprobs (`want_logprobs`).

Those runtime conditionals cost a host round trip on XLA:GPU: the runtime copies each predicate
to the host, so dispatching the program waits for the forward before it (4.5 ms of an 8 ms batch-1
step on the H200, bench/RESULTS.md). The runner therefore also compiles `SampleMode`
specializations, where the host (which knows every request's parameters) decides the branches
and the program has no conditional: `sample(logits, t, mode)`. `mode=None` is the general program.

Axis letters: B requests, V vocab, W = ceil(V / 32) bitmask words, K top logprobs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.runner_core import ReqState
from xlaserve.sampling_params import SamplingParams

# Top logprobs are always computed at the API maximum (SamplingParams allows <= 20) and cut on
# the host, so the number asked never changes a compiled shape.
MAX_LOGPROBS = 20
GREEDY_EPS = 1e-5  # temperature below this = greedy

_FIELDS = [
    "temperature", "top_k", "top_p", "min_p", "seeds", "steps", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "min_tokens", "stop_ids", "bias", "bitmask",
    "output_counts", "prompt_mask", "use_extras", "want_logprobs",
]  # fmt: skip
# min_tokens' stop-token mask travels as up to STOP_SLOTS token ids per row (-1 = none) in the
# packed parameters and is applied by every sampler program: a request with min_tokens needs no
# dense [B, V] bias (a [256, 128k] float32 upload a step) nor the "extras" specialization. A
# request with more stop tokens than that takes the dense bias instead.
STOP_SLOTS = 8


class SampleMode(NamedTuple):
    """The branches of one sampler specialization, decided on the host (`sample_mode`): the
    dense extras, the random path (some row has temperature > 0), the top-k/top-p/min-p filter
    (some row filters) and the logprobs."""

    extras: bool = False
    random: bool = False
    filter: bool = False
    logprobs: bool = False

    @property
    def tag(self) -> str:
        """e.g. "-rf-": one letter per branch taken (program names)."""
        return "".join(c if on else "-" for c, on in zip("erfl", self, strict=True))


GREEDY = SampleMode()


def sample_mode(
    rows: list[ReqState | None], extras: bool, logprobs: bool, vocab: int
) -> SampleMode:
    """The branches the general program would take for these rows (None rows are greedy padding
    with neutral parameters): the same predicates as `sample` / `filter_logits` evaluate on the
    device, so a specialization computes exactly what the general program does."""
    rand = filt = False
    for r in rows:
        if r is None:
            continue
        p = r.params
        rand |= p.temperature >= GREEDY_EPS
        filt |= (0 < p.top_k < vocab) or p.top_p < 1.0 or p.min_p > 0.0
    return SampleMode(extras, rand, rand and filt, logprobs)


# Bits of `row_flags`: what a request's sampling asks of every step (fixed for its lifetime,
# cached on the runner's state), so a step's mode and extras come from one OR over the rows.
FLAG_EXTRAS = 1  # logit_bias / token constraints / penalties: the dense extras every step
FLAG_LOGPROBS = 2
FLAG_RANDOM = 4  # temperature >= GREEDY_EPS
FLAG_FILTER = 8  # top-k / top-p / min-p filters (counts only with FLAG_RANDOM)
FLAG_DENSE_STOPS = 16  # min_tokens masks more stop ids than the packed slots: dense while it lasts


def row_flags(p: SamplingParams, vocab: int) -> int:
    """The FLAG_* bits of a request (`step_summary`); the same predicates as `needs_extras`
    and `sample_mode`."""
    f = 0
    if p.logit_bias or p.has_token_constraints or p.needs_penalties:
        f |= FLAG_EXTRAS
    if p.logprobs is not None:
        f |= FLAG_LOGPROBS
    if p.temperature >= GREEDY_EPS:
        f |= FLAG_RANDOM
    if (0 < p.top_k < vocab) or p.top_p < 1.0 or p.min_p > 0.0:
        f |= FLAG_FILTER
    if p.min_tokens > 0 and p.all_stop_token_ids() and not packed_stops(p):
        f |= FLAG_DENSE_STOPS
    return f


def step_summary(
    rows: list[ReqState | None], req_ids: list[str], bitmasks: dict
) -> tuple[bool, bool, bool, bool]:
    """(extras, logprobs, random, filter) of a step's rows from their cached `row_flags` (the
    rows' `flags` attribute; None rows count as greedy padding): equal to
    `any(needs_extras(...))`, the logprobs test and `sample_mode`'s branches, in one pass."""
    f = 0
    for r in rows:
        if r is not None:
            f |= r.flags  # type: ignore[attr-defined]
    extras = bool(f & FLAG_EXTRAS)
    if not extras and bitmasks:
        extras = any(
            r is not None and rid in bitmasks for r, rid in zip(rows, req_ids, strict=False)
        )
    if not extras and f & FLAG_DENSE_STOPS:
        extras = any(
            r is not None
            and r.flags & FLAG_DENSE_STOPS  # type: ignore[attr-defined]
            and r.num_output < r.params.min_tokens
            for r in rows
        )
    rand = bool(f & FLAG_RANDOM)
    return extras, bool(f & FLAG_LOGPROBS), rand, rand and bool(f & FLAG_FILTER)


def _branch(pred: bool | jax.Array, on_true: Callable, on_false: Callable, *ops: object) -> object:
    """`lax.cond` for a traced predicate; for a Python bool (a `SampleMode` field) the branch
    is chosen while tracing and the program has no conditional."""
    if isinstance(pred, bool):
        return (on_true if pred else on_false)(*ops)
    return jax.lax.cond(pred, on_true, on_false, *ops)


@functools.partial(jax.tree_util.register_dataclass, data_fields=_FIELDS, meta_fields=[])
@dataclass(frozen=True)
class SamplingTensors:
    temperature: jax.Array  # f32 [B]; < GREEDY_EPS = greedy
    top_k: jax.Array  # i32 [B]; 0 = off
    top_p: jax.Array  # f32 [B]; 1 = off
    min_p: jax.Array  # f32 [B]; 0 = off
    seeds: jax.Array  # u32 [B]: per-request seed (the request's own, or drawn once by the runner)
    steps: jax.Array  # i32 [B]: tokens the request sampled before (folded into its key)
    repetition_penalty: jax.Array  # f32 [B]; 1 = off
    frequency_penalty: jax.Array  # f32 [B]
    presence_penalty: jax.Array  # f32 [B]
    min_tokens: jax.Array  # i32 [B]: stop_ids are masked while steps < min_tokens
    stop_ids: jax.Array  # i32 [B, STOP_SLOTS]: the row's stop tokens, -1 = none
    bias: jax.Array  # f32 [B, V]: logit_bias; -inf for stop tokens under min_tokens when the
    # request has more than STOP_SLOTS of them
    bitmask: jax.Array  # i32 [B, W]: structured-output allowed tokens (all bits 1 = any)
    output_counts: jax.Array  # i32 [B, V]: occurrences of each token in the output
    prompt_mask: jax.Array  # bool [B, V]: token occurs in the prompt
    use_extras: jax.Array  # bool []: apply bias, bitmask and penalties (else they are neutral)
    want_logprobs: jax.Array  # bool []: compute logprobs / ranks (else zeros)


def host_tensors(b: int, vocab: int, extras: bool = True) -> dict[str, np.ndarray]:
    """Neutral host arrays of every SamplingTensors field for B = b rows (greedy, no extras).
    With `extras` False the dense [B, V] fields are left out (the runner keeps neutral ones on
    the device)."""
    f32 = np.float32
    out = dict(
        temperature=np.zeros(b, f32), top_k=np.zeros(b, np.int32), top_p=np.ones(b, f32),
        min_p=np.zeros(b, f32), seeds=np.zeros(b, np.uint32), steps=np.zeros(b, np.int32),
        repetition_penalty=np.ones(b, f32), frequency_penalty=np.zeros(b, f32),
        presence_penalty=np.zeros(b, f32), min_tokens=np.zeros(b, np.int32),
        stop_ids=np.full((b, STOP_SLOTS), -1, np.int32), use_extras=np.asarray(False),
        want_logprobs=np.asarray(False),
    )  # fmt: skip
    if extras:
        out.update(neutral_extras(b, vocab))
    return out


def neutral_extras(b: int, vocab: int) -> dict[str, np.ndarray]:
    """Dense fields that change nothing: zero bias, every token allowed, no counts, no prompt."""
    return dict(
        bias=np.zeros((b, vocab), np.float32),
        bitmask=np.full((b, -(-vocab // 32)), -1, np.int32),
        output_counts=np.zeros((b, vocab), np.int32),
        prompt_mask=np.zeros((b, vocab), bool),
    )


# The per-row fields that travel packed (`pack_params`): one int32 word per row each (floats and
# the uint32 seeds bit-cast), then STOP_SLOTS words of stop ids, then the two flags. Dense [B, V]
# fields travel on their own.
SMALL_FIELDS: list[tuple[str, np.dtype]] = [
    ("temperature", np.dtype(np.float32)), ("top_k", np.dtype(np.int32)),
    ("top_p", np.dtype(np.float32)), ("min_p", np.dtype(np.float32)),
    ("seeds", np.dtype(np.uint32)), ("steps", np.dtype(np.int32)),
    ("repetition_penalty", np.dtype(np.float32)), ("frequency_penalty", np.dtype(np.float32)),
    ("presence_penalty", np.dtype(np.float32)), ("min_tokens", np.dtype(np.int32)),
]  # fmt: skip
PARAM_ROWS = len(SMALL_FIELDS) + STOP_SLOTS  # packed words per request row
DENSE_FIELDS = ("bias", "bitmask", "output_counts", "prompt_mask")


STEPS_ROW = [name for name, _ in SMALL_FIELDS].index("steps")


def stop_slots(p: SamplingParams) -> np.ndarray | None:
    """The request's stop ids for the packed min_tokens mask (i32 [STOP_SLOTS], -1 padded), or
    None when min_tokens masks nothing or the ids do not fit (the dense bias masks them)."""
    ids = sorted(p.all_stop_token_ids()) if p.min_tokens else []
    if not ids or len(ids) > STOP_SLOTS:
        return None
    out = np.full(STOP_SLOTS, -1, np.int32)
    out[: len(ids)] = ids
    return out


def packed_stops(p: SamplingParams) -> bool:
    """min_tokens' stop mask of this request travels packed (`stop_slots`), not in the bias."""
    return stop_slots(p) is not None


def param_words(p: SamplingParams, seed: int) -> np.ndarray:
    """A request's packed sampler row (i32 [PARAM_ROWS], steps 0): computed once per request so
    a step only stacks rows and writes the steps."""
    stops = stop_slots(p)
    vals = dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                seeds=seed, steps=0, repetition_penalty=p.repetition_penalty,
                frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                min_tokens=p.min_tokens if stops is not None else 0)  # fmt: skip
    words = np.array([np.asarray(vals[n], dt).view(np.int32) for n, dt in SMALL_FIELDS], np.int32)
    return np.concatenate(
        [words, stops if stops is not None else np.full(STOP_SLOTS, -1, np.int32)]
    )


def sampler_words(r: int) -> int:
    """int32 words of the packed parameters of up to r rows: [PARAM_ROWS, r] + 2 flags."""
    return PARAM_ROWS * r + 2


def pack_params(h: dict[str, np.ndarray], out: np.ndarray) -> None:
    """Write host fields (`host_tensors` / `sampling_host`, b <= r rows) into `out` (i32
    [sampler_words(r)]): row k of the [PARAM_ROWS, r] block = field k bit-cast to int32, then
    the STOP_SLOTS stop-id rows; rows past b keep what `out` held; the last two words are
    use_extras and want_logprobs."""
    r = (out.shape[0] - 2) // PARAM_ROWS
    grid = out[:-2].reshape(PARAM_ROWS, r)
    for k, (name, dt) in enumerate(SMALL_FIELDS):
        col = np.asarray(h[name], dt)
        grid[k, : col.shape[0]] = col.view(np.int32)
    stops = np.asarray(h["stop_ids"], np.int32)  # [b, STOP_SLOTS]
    grid[len(SMALL_FIELDS) :, : stops.shape[0]] = stops.T
    out[-2], out[-1] = bool(h["use_extras"]), bool(h["want_logprobs"])


def unpack_params(words: jax.Array, r: int, b: int, dense: dict[str, jax.Array]) -> SamplingTensors:
    """Inside a program: packed i32 [sampler_words(r)] (first b rows used) + the dense fields
    -> SamplingTensors of b rows."""
    grid = words[:-2].reshape(PARAM_ROWS, r)[:, :b]
    small = {
        name: grid[k] if dt == np.int32 else jax.lax.bitcast_convert_type(grid[k], dt)
        for k, (name, dt) in enumerate(SMALL_FIELDS)
    }
    return SamplingTensors(
        **small, stop_ids=grid[len(SMALL_FIELDS) :].T, **dense, use_extras=words[-2] != 0,
        want_logprobs=words[-1] != 0,
    )  # fmt: skip


def mask_stop_ids(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """min_tokens: -inf at each row's stop ids while it has sampled fewer than min_tokens
    tokens (t.steps); one [B, STOP_SLOTS] scatter, unused slots dropped."""
    b, v = logits.shape
    active = (t.steps < t.min_tokens)[:, None] & (t.stop_ids >= 0)
    ids = jnp.where(active, t.stop_ids, v)  # v: out of range, dropped
    return logits.at[jnp.arange(b)[:, None], ids].set(-jnp.inf, mode="drop")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["token_ids", "logprobs", "logprob_ids", "ranks", "has_nan"],
    meta_fields=[],
)
@dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # i32 [B]
    logprobs: (
        jax.Array
    )  # f32 [B, 1+K]: sampled token, then the top K (raw distribution); 0 if not asked
    logprob_ids: jax.Array  # i32 [B, 1+K]
    ranks: jax.Array  # i32 [B]: 1-based rank of the sampled token
    has_nan: jax.Array  # bool [B]: the row's logits contain NaN (the request fails)


def unpack_bitmask(bitmask: jax.Array, vocab: int) -> jax.Array:
    """i32 [B, W] -> bool [B, V]: bit i of word w allows token 32 * w + i."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(bool)


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Repetition (prompt + output: positive logits divided, negative multiplied), then
    frequency (minus count in output) and presence (minus once if in output)."""
    counts = t.output_counts
    seen = (counts > 0) | t.prompt_mask
    rp = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - t.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return logits - t.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)


def _apply_extras(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    logits = logits + t.bias
    logits = jnp.where(unpack_bitmask(t.bitmask, logits.shape[-1]), logits, -jnp.inf)
    return apply_penalties(logits, t)


def filter_logits(
    logits: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    needed: bool | None = None,
) -> jax.Array:
    """top_k, then top_p over the top-k renormalized, then min_p; filtered entries -> -inf.
    A batch where no row filters skips the [B, V] sort (a `lax.cond`, or `needed` decided on
    the host)."""
    v = logits.shape[-1]
    if needed is None:
        needed = jnp.any((top_k > 0) & (top_k < v)) | jnp.any(top_p < 1.0) | jnp.any(min_p > 0.0)
    return _branch(needed, _filter_sorted, lambda x, *_: x, logits, top_k, top_p, min_p)


def _filter_sorted(
    logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
) -> jax.Array:
    v = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # [B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)  # [B]
    idx = jnp.arange(v)[None, :]
    in_k = idx < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, -jnp.inf), axis=-1)
    # Keep a sorted entry while the mass before it is below top_p (the first always stays).
    keep = in_k & ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None])
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)  # [B, 1]
    # min_p: p >= min_p * p_max  <=>  logit >= max_logit + log(min_p).
    min_logit = sorted_desc[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    threshold = jnp.where(min_p[:, None] > 0, jnp.maximum(threshold, min_logit), threshold)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, steps)


def _logprobs(raw: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Entry 0 = `token_ids`' logprob, then the top K of the raw distribution; 1-based ranks."""
    lp = jax.nn.log_softmax(raw, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, raw.shape[-1]))
    tok_lp = jnp.take_along_axis(lp, token_ids[:, None], axis=-1)  # [B, 1]
    ranks = 1 + jnp.sum(lp > tok_lp, axis=-1).astype(jnp.int32)
    ids = jnp.concatenate([token_ids[:, None], top_ids.astype(jnp.int32)], axis=-1)
    return jnp.concatenate([tok_lp, top_lp], axis=-1), ids, ranks


def sample(logits: jax.Array, t: SamplingTensors, mode: SampleMode | None = None) -> SamplerOutput:
    """logits f32 [B, V] (raw model output) -> SamplerOutput. mode None: one program for every
    feature (runtime conditionals); a SampleMode: its branches only (t's flags are ignored)."""
    raw = logits
    b, v = logits.shape
    use_extras = t.use_extras if mode is None else mode.extras
    logits = _branch(use_extras, _apply_extras, lambda x, _: x, mask_stop_ids(logits, t), t)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy = t.temperature < GREEDY_EPS

    def random_ids(x: jax.Array) -> jax.Array:
        scaled = x / jnp.where(greedy, 1.0, t.temperature)[:, None]
        needed = None if mode is None else mode.filter
        filtered = filter_logits(scaled, t.top_k, t.top_p, t.min_p, needed)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(
            _row_keys(t.seeds, t.steps)
        )
        return jnp.argmax(filtered + gumbel, axis=-1).astype(jnp.int32)

    # All-greedy steps (the common serving case) skip the sort and the noise entirely.
    all_greedy = jnp.all(greedy) if mode is None else not mode.random
    sampled = _branch(all_greedy, lambda x: greedy_ids, random_ids, logits)
    token_ids = jnp.where(greedy, greedy_ids, sampled)
    has_nan = jnp.any(jnp.isnan(raw), axis=-1)
    k = 1 + min(MAX_LOGPROBS, v)

    def no_logprobs(_r: jax.Array, _ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return jnp.zeros((b, k), jnp.float32), jnp.zeros((b, k), jnp.int32), jnp.zeros(b, jnp.int32)

    want = t.want_logprobs if mode is None else mode.logprobs
    lps, ids, ranks = _branch(want, _logprobs, no_logprobs, raw, token_ids)
    return SamplerOutput(token_ids, lps, ids, ranks, has_nan)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prompt logprobs: logits f32 [T, V], targets i32 [T] -> (logprobs [T, 1+K], ids [T, 1+K],
    ranks [T]) with entry 0 the target token, then the top K of the raw distribution."""
    return _logprobs(logits, targets)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["token_ids", "num_tokens", "logprobs", "logprob_ids", "ranks", "has_nan"],
    meta_fields=[],
)
@dataclass(frozen=True)
class VerifyOutput:
    token_ids: jax.Array  # i32 [B, K+1]: accepted drafts, then the bonus/recovered token; padded
    num_tokens: jax.Array  # i32 [B]: 1..d+1 tokens emitted
    logprobs: jax.Array  # f32 [B*(K+1), 1+M]: per emitted token (raw distribution); 0 if not asked
    logprob_ids: jax.Array  # i32 [B*(K+1), 1+M]
    ranks: jax.Array  # i32 [B*(K+1)]
    has_nan: jax.Array  # bool [B]


def verify(
    logits: jax.Array, t: SamplingTensors, drafts: jax.Array, num_drafts: jax.Array
) -> VerifyOutput:
    """Speculative verification (contract: xlaserve.spec_decode.rejection), one program per B.

    logits f32 [B*(K+1), V] raw: row (b, j) scores position j of request b (j > d_b: padding
    copies of row d_b); `t` has one row per (b, j), processed like `sample` (its counts / bias /
    bitmask / steps already those of position j). drafts i32 [B, K] (padded), num_drafts i32 [B].
    Greedy: accept while draft == argmax. Sampled: accept with prob p(x) (one-hot q), on
    rejection sample p with the draft removed, else the bonus token from p_d."""
    raw = logits
    n, v = logits.shape
    b, k = drafts.shape
    k1 = k + 1
    logits = jax.lax.cond(t.use_extras, _apply_extras, lambda x, _: x, mask_stop_ids(logits, t), t)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(b, k1)
    greedy_row = t.temperature < GREEDY_EPS
    greedy_req = greedy_row.reshape(b, k1)[:, 0]
    valid = jnp.arange(k)[None, :] < num_drafts[:, None]  # [B, K]
    pos = jnp.arange(k1)[None, :]

    def random_path(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        scaled = x / jnp.where(greedy_row, 1.0, t.temperature)[:, None]
        logp = jax.nn.log_softmax(filter_logits(scaled, t.top_k, t.top_p, t.min_p), axis=-1)
        logp = logp.reshape(b, k1, v)
        keys = _row_keys(t.seeds, t.steps)
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(keys)
        p_x = jnp.take_along_axis(logp[:, :k], drafts[:, :, None], axis=-1)[..., 0]  # [B, K]
        accept = jnp.log(u.reshape(b, k1)[:, :k]) < p_x  # u < p(x) / 1
        # Residual norm(max(0, p - onehot(x))) = p without the draft (where a draft exists).
        drop = jax.nn.one_hot(jnp.pad(drafts, ((0, 0), (0, 1))), v, dtype=bool)
        drop &= jnp.pad(valid, ((0, 0), (0, 1)))[:, :, None]
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(keys)
        resid = jnp.where(drop, -jnp.inf, logp) + gumbel.reshape(b, k1, v)
        return accept, jnp.argmax(resid, axis=-1).astype(jnp.int32)

    def greedy_path(_x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.zeros((b, k), bool), greedy_ids

    accept_s, sampled = jax.lax.cond(jnp.all(greedy_row), greedy_path, random_path, logits)
    accept = jnp.where(greedy_req[:, None], drafts == greedy_ids[:, :k], accept_s) & valid
    n_acc = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]
    last = jnp.where(greedy_req[:, None], greedy_ids, sampled)
    final = jnp.take_along_axis(last, n_acc[:, None], axis=1)  # [B, 1]
    padded = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(pos < n_acc[:, None], padded, jnp.where(pos == n_acc[:, None], final, 0))
    has_nan = jnp.any(jnp.isnan(raw).reshape(b, k1, v), axis=(1, 2))
    m = 1 + min(MAX_LOGPROBS, v)

    def no_logprobs(_r: jax.Array, _ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return jnp.zeros((n, m), jnp.float32), jnp.zeros((n, m), jnp.int32), jnp.zeros(n, jnp.int32)

    lps, ids, ranks = jax.lax.cond(t.want_logprobs, _logprobs, no_logprobs, raw, tokens.reshape(n))
    return VerifyOutput(tokens, n_acc + 1, lps, ids, ranks, has_nan)


def sampling_host(
    rows: list[ReqState | None],
    req_ids: list[str],
    b: int,
    v: int,
    extras: bool,
    with_logprobs: bool,
    bitmasks: dict,
    positions: list[int] | None = None,
    prefixes: list[list[int]] | None = None,
) -> dict[str, np.ndarray]:
    """Host fields of the SamplingTensors of b padded rows (`host_tensors`), filled from the
    runner's per-request states (runner_core.ReqState + seed, output_counts, prompt_mask); rows
    that do not sample this step (None) are greedy. bitmasks: req_id -> i32 [positions, W] (row 0
    is this step's). With speculation, row i scores position positions[i] after the drafts
    prefixes[i] (counts, steps, bitmask row). Dense fields no row uses are left out (the runner
    keeps device-resident neutral ones)."""

    h = host_tensors(b, v, extras)
    h["use_extras"], h["want_logprobs"] = np.asarray(extras), np.asarray(with_logprobs)
    dense_stops = False  # some row's min_tokens stops went into the bias (too many to pack)
    for i, r in enumerate(rows):
        if r is None:
            continue
        p = r.params
        j = positions[i] if positions is not None else 0
        n_out = r.num_output + j
        h["temperature"][i], h["top_k"][i], h["top_p"][i] = p.temperature, p.top_k, p.top_p
        h["min_p"][i], h["seeds"][i], h["steps"][i] = p.min_p, r.seed, n_out
        h["repetition_penalty"][i] = p.repetition_penalty
        h["frequency_penalty"][i] = p.frequency_penalty
        h["presence_penalty"][i] = p.presence_penalty
        stops = stop_slots(p)
        if stops is not None:
            h["min_tokens"][i], h["stop_ids"][i] = p.min_tokens, stops
        if not extras:
            continue
        for tok, val in (p.logit_bias or {}).items():
            if 0 <= tok < v:
                h["bias"][i, tok] += val
        if n_out < p.min_tokens and stops is None:  # more stop ids than the packed slots
            stop = [t for t in p.all_stop_token_ids() if 0 <= t < v]
            h["bias"][i, stop] = -np.inf
            dense_stops = True
        if p.has_token_constraints:  # bad_words, allowed_token_ids (processors: torch only)
            out_ids = r.output_ids + (prefixes[i] if prefixes is not None else [])
            banned = [t for t in p.banned_token_ids(out_ids) if 0 <= t < v]
            h["bias"][i, banned] = -np.inf
            off = p.disallowed_mask(v)
            if off is not None:
                h["bias"][i, off] = -np.inf
        if req_ids[i] in bitmasks:
            w = h["bitmask"].shape[1]
            mask = np.asarray(bitmasks[req_ids[i]], np.int32).reshape(-1, w)
            if mask.shape[0] <= j:
                raise ValueError(
                    f"{req_ids[i]}: grammar bitmask has {mask.shape[0]} rows, position {j} scored"
                )
            h["bitmask"][i] = mask[j]
        if r.output_counts is not None:
            h["output_counts"][i], h["prompt_mask"][i] = r.output_counts, r.prompt_mask
            for tok in prefixes[i] if prefixes is not None else ():
                if 0 <= tok < v:
                    h["output_counts"][i, tok] += 1
    if extras:  # copy only the dense fields some row uses; the others stay device-resident
        live = [(i, r) for i, r in enumerate(rows) if r is not None]
        if not any(req_ids[i] in bitmasks for i, _ in live):
            del h["bitmask"]
        if not any(r.output_counts is not None for _, r in live):
            del h["output_counts"], h["prompt_mask"]
        if not dense_stops and not any(
            r.params.logit_bias or r.params.has_token_constraints for _, r in live
        ):
            del h["bias"]
    return h


def needs_extras(r: ReqState | None, rid: str, bitmasks: dict) -> bool:
    """The row needs the dense extras (bias, bitmask, penalty counts) of the sampler."""
    if r is None:
        return False
    p = r.params
    return bool(
        p.logit_bias
        or p.has_token_constraints
        or p.needs_penalties
        or rid in bitmasks
        # min_tokens: the packed stop ids mask it in every program (the runner's states cache
        # `packed_stops`; other states ask the params)
        or (p.masks_stop_tokens(r.num_output) and not _packed(r))
    )


def _packed(r: ReqState) -> bool:
    """`packed_stops` of the request: the runner state's cached value where it has one."""
    cached = getattr(r, "packed_stops", None)
    return packed_stops(r.params) if cached is None else cached


def verify_rows(
    reqs: list[ReqState | None], req_ids: list[str], batch_drafts: list[list[int]], b: int, k: int
) -> tuple[list[ReqState | None], list[str], list[int], list[list[int]], np.ndarray, np.ndarray]:
    """The 1 + K scored rows per request of a verify program over request bucket b: per row
    (state or None, req id, draft position, drafts before it), and drafts [b, K] / num_drafts
    [b]. reqs[i] is None for a request that does not sample; padding rows repeat the last real
    position."""
    rows: list[ReqState | None] = []
    rids: list[str] = []
    positions: list[int] = []
    prefixes: list[list[int]] = []
    drafts = np.zeros((b, k), np.int32)
    num_drafts = np.zeros(b, np.int32)
    for i in range(b):
        r = reqs[i] if i < len(reqs) else None
        ds = batch_drafts[i] if r is not None else []
        drafts[i, : len(ds)], num_drafts[i] = ds, len(ds)
        for j in range(k + 1):
            jj = min(j, len(ds))  # padding rows repeat the last real position
            rows.append(r)
            rids.append(req_ids[i] if r is not None else "")
            positions.append(jj)
            prefixes.append(ds[:jj])
    return rows, rids, positions, prefixes, drafts, num_drafts
