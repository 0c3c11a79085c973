"""On-device sampling with the full SamplingParams semantics (order: sampling_params.py docstring).

All per-request parameters of a step are batched into padded arrays (`SamplingTensors`, rows =
the request bucket B), so one jitted function serves a bucket. The optional dense inputs
(`bias`, `bitmask`, `output_counts`, `prompt_mask`) are None when no request of the step needs
them: None changes the pytree structure, so "plain" and "extras" steps are two compiled variants
per bucket, both compiled at start-up.

Axis letters: B requests, V vocab, W = ceil(V / 32) bitmask words, K top logprobs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

# Top logprobs are always computed at the API maximum (SamplingParams allows <= 20) and cut on
# the host, so the number asked never changes a compiled shape.
MAX_LOGPROBS = 20


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "temperature", "top_k", "top_p", "min_p", "seeds", "steps", "repetition_penalty",
        "frequency_penalty", "presence_penalty", "bias", "bitmask", "output_counts", "prompt_mask",
    ],
    meta_fields=[],
)  # fmt: skip
@dataclass(frozen=True)
class SamplingTensors:
    temperature: jax.Array  # f32 [B]; 0 = greedy
    top_k: jax.Array  # i32 [B]; 0 = off
    top_p: jax.Array  # f32 [B]; 1 = off
    min_p: jax.Array  # f32 [B]; 0 = off
    seeds: jax.Array  # u32 [B]: per-request seed (the request's own, or drawn once by the runner)
    steps: jax.Array  # i32 [B]: tokens the request sampled before (folded into its key)
    repetition_penalty: jax.Array  # f32 [B]; 1 = off
    frequency_penalty: jax.Array  # f32 [B]
    presence_penalty: jax.Array  # f32 [B]
    bias: jax.Array | None = None  # f32 [B, V]: logit_bias, -inf for stop tokens under min_tokens
    bitmask: jax.Array | None = (
        None  # i32 [B, W]: structured-output allowed tokens (all bits 1 = any)
    )
    output_counts: jax.Array | None = None  # i32 [B, V]: occurrences of each token in the output
    prompt_mask: jax.Array | None = None  # bool [B, V]: token occurs in the prompt


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["token_ids", "logprobs", "logprob_ids", "ranks", "has_nan"],
    meta_fields=[],
)
@dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # i32 [B]
    logprobs: jax.Array | None  # f32 [B, 1+K]: sampled token, then the top K (raw distribution)
    logprob_ids: jax.Array | None  # i32 [B, 1+K]
    ranks: jax.Array | None  # i32 [B]: 1-based rank of the sampled token
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


def filter_logits(
    logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
) -> jax.Array:
    """top_k, then top_p over the top-k renormalized, then min_p; filtered entries -> -inf."""
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


def sample(logits: jax.Array, t: SamplingTensors, with_logprobs: bool) -> SamplerOutput:
    """logits f32 [B, V] (raw model output) -> SamplerOutput. Jit with `with_logprobs` static."""
    raw = logits
    v = logits.shape[-1]
    if t.bias is not None:
        logits = logits + t.bias
    if t.bitmask is not None:
        logits = jnp.where(unpack_bitmask(t.bitmask, v), logits, -jnp.inf)
    if t.output_counts is not None:
        logits = apply_penalties(logits, t)
    greedy_ids = jnp.argmax(logits, axis=-1)
    greedy = t.temperature < 1e-5
    scaled = logits / jnp.where(greedy, 1.0, t.temperature)[:, None]
    filtered = filter_logits(scaled, t.top_k, t.top_p, t.min_p)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(
        _row_keys(t.seeds, t.steps)
    )
    sampled_ids = jnp.argmax(filtered + gumbel, axis=-1)
    token_ids = jnp.where(greedy, greedy_ids, sampled_ids).astype(jnp.int32)
    has_nan = jnp.any(jnp.isnan(raw), axis=-1)
    if not with_logprobs:
        return SamplerOutput(token_ids, None, None, None, has_nan)
    lp = jax.nn.log_softmax(raw, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, v))
    tok_lp = jnp.take_along_axis(lp, token_ids[:, None], axis=-1)  # [B, 1]
    ranks = 1 + jnp.sum(lp > tok_lp, axis=-1).astype(jnp.int32)
    return SamplerOutput(
        token_ids,
        jnp.concatenate([tok_lp, top_lp], axis=-1),
        jnp.concatenate([token_ids[:, None], top_ids.astype(jnp.int32)], axis=-1),
        ranks,
        has_nan,
    )


def token_logprobs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prompt logprobs: logits f32 [T, V], targets i32 [T] -> (logprobs [T, 1+K], ids [T, 1+K],
    ranks [T]) with entry 0 the target token, then the top K of the raw distribution."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, logits.shape[-1]))
    tgt_lp = jnp.take_along_axis(lp, targets[:, None], axis=-1)
    ranks = 1 + jnp.sum(lp > tgt_lp, axis=-1).astype(jnp.int32)
    ids = jnp.concatenate([targets[:, None], top_ids.astype(jnp.int32)], axis=-1)
    return jnp.concatenate([tgt_lp, top_lp], axis=-1), ids, ranks
