"""The Flax Llama-family model against transformers: logits of a mixed, chunked batch over the
paged cache (block_size 4, shuffled block tables)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from xla_helpers import hf_logits

from xlaserve.model_loader.registry import build_spec
from xlaserve.models_flax import get_model_class
from xlaserve.models_flax.attention import AttentionMetadata
from xlaserve.models_flax.loader import load_model

BLOCK = 4
NUM_BLOCKS = 12


def _step(model, caches, chunks: list[tuple[list[int], int, list[int]]]):  # noqa: ANN001, ANN202
    """Run one step; chunks = (tokens of this chunk, start position, block ids) per request."""
    ids, pos, slots, cu, kv_lens = [], [], [], [0], []
    width = max(len(b) for _, _, b in chunks)
    tables = np.zeros((len(chunks), width), np.int32)
    for i, (toks, start, blocks) in enumerate(chunks):
        p = np.arange(start, start + len(toks))
        ids += toks
        pos += p.tolist()
        slots += (np.asarray(blocks)[p // BLOCK] * BLOCK + p % BLOCK).tolist()
        cu.append(cu[-1] + len(toks))
        kv_lens.append(start + len(toks))
        tables[i, : len(blocks)] = blocks
    pad = 3  # padding tokens must be harmless
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots + [-1] * pad, jnp.int32),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        block_tables=jnp.asarray(tables),
        cu_q_lens=jnp.asarray(cu, jnp.int32),
        num_seqs=jnp.asarray([len(chunks)], jnp.int32),
    )
    hidden, caches = model(
        jnp.asarray(ids + [0] * pad, jnp.int32), jnp.asarray(pos + [0] * pad, jnp.int32), caches, md
    )
    return np.asarray(model.compute_logits(hidden))[: len(ids)], caches


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "llama3"])
def test_logits_match_transformers(kind: str, tiny_model_dir) -> None:  # noqa: ANN001
    from flax import nnx

    path = tiny_model_dir(kind)
    spec = build_spec(path)
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    graphdef, state = load_model(spec, jnp.float32, mesh)
    model = nnx.merge(graphdef, state)
    assert isinstance(model, get_model_class(spec.family))
    if kind == "mistral":
        assert spec.sliding_window is not None and spec.sliding_window < 20
    rng = np.random.default_rng(1)
    a = rng.integers(1, spec.vocab_size, 20).tolist()
    b = rng.integers(1, spec.vocab_size, 13).tolist()
    blocks_a, blocks_b = [7, 2, 9, 4, 0], [1, 8, 3, 6]
    caches = [
        (jnp.zeros((NUM_BLOCKS, BLOCK, spec.num_kv_heads, spec.head_dim), jnp.float32),) * 2
    ] * spec.num_layers
    # Step 1: first 11 tokens of a (a partial prefill chunk) + all of b; step 2: the rest of a.
    with jax.default_matmul_precision("highest"):  # GPUs default to TF32 for float32 matmuls
        l1, caches = _step(model, caches, [(a[:11], 0, blocks_a[:3]), (b, 0, blocks_b)])
        l2, caches = _step(model, caches, [(a[11:], 11, blocks_a)])
    ref_a, ref_b = hf_logits(path, a), hf_logits(path, b)
    got_a = np.concatenate([l1[:11], l2])
    scale = max(np.abs(ref_a).max(), 1.0)
    np.testing.assert_allclose(got_a, ref_a, atol=1e-4 * scale, rtol=1e-4)
    np.testing.assert_allclose(l1[11:], ref_b, atol=1e-4 * scale, rtol=1e-4)
    # Not trivially equal: the prompts give different distributions.
    assert np.abs(ref_a[-1] - ref_b[-1]).max() > 1e-2


def test_unknown_family_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no Flax implementation"):
        get_model_class("nope")


def test_decoder_layers_are_traced_once_per_program(tiny_model_dir, monkeypatch) -> None:  # noqa: ANN001
    """Identical layers are one nested jit (layers.call_block): lowering a forward traces the
    layer once however many layers the model has, and once more for each new token count; the
    lowered module calls one layer function from every layer."""
    from flax import nnx

    from xlaserve.models_flax.decoder import DecoderLayer

    spec = build_spec(tiny_model_dir("llama"))
    assert spec.num_layers >= 2
    graphdef, state = load_model(spec, jnp.float32, Mesh(np.array(jax.devices()[:1]), ("model",)))
    traced: list[int] = []
    real_call = DecoderLayer.__call__

    def counting(self, x, *args):  # noqa: ANN001, ANN202
        traced.append(x.shape[0])
        return real_call(self, x, *args)

    monkeypatch.setattr(DecoderLayer, "__call__", counting)
    cache = (jnp.zeros((NUM_BLOCKS, BLOCK, spec.num_kv_heads, spec.head_dim), jnp.float32),) * 2

    @jax.jit
    def forward(state, ids, caches):  # noqa: ANN001, ANN202
        t = ids.shape[0]
        md = AttentionMetadata(
            slot_mapping=jnp.arange(t, dtype=jnp.int32),
            kv_lens=jnp.asarray([t], jnp.int32),
            block_tables=jnp.arange(NUM_BLOCKS, dtype=jnp.int32)[None],
            cu_q_lens=jnp.asarray([0, t], jnp.int32),
            num_seqs=jnp.asarray([1], jnp.int32),
        )
        return nnx.merge(graphdef, state)(ids, jnp.arange(t, dtype=jnp.int32), caches, md)

    texts = [
        forward.lower(state, jnp.zeros(t, jnp.int32), [cache] * spec.num_layers).as_text()
        for t in (8, 16, 8)
    ]
    assert traced == [8, 16]  # the third lowering (8 tokens again) reuses the first's trace
    calls = [line for line in texts[0].splitlines() if "call @_apply_block" in line]
    callees = {line.split("call @")[1].split("(")[0] for line in calls}
    assert len(calls) == spec.num_layers and len(callees) == 1, calls
    assert texts[0].count("func.func private @_apply_block") == 1
