"""Torch Llama-family model with a paged KV cache vs HF transformers (float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_hf_models import FAMILIES, load_hf

from xlaserve.backends_torch.layers.attention import AttentionMetadata
from xlaserve.backends_torch.models import get_model_class
from xlaserve.model_loader.registry import build_spec, iter_canonical_weights

S = 4  # block size: sequences span several blocks
N = 64
ATOL = 1e-4


def _md(blocks: list[int], start: int, end: int) -> AttentionMetadata:
    n = end - start
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=torch.tensor([blocks], dtype=torch.int32),
        slot_mapping=torch.tensor([blocks[p // S] * S + p % S for p in range(start, end)]),
        max_query_len=n,
        max_seq_len=end,
        query_start_loc_host=[0, n],
        seq_lens_host=[end],
    )


def _ours(model_dir: str):
    spec = build_spec(model_dir)
    model = get_model_class(spec.family)(spec, dtype=torch.float32, device="cpu")
    model.load_weights(iter_canonical_weights(spec))
    caches = [
        (
            torch.zeros(N, S, spec.num_kv_heads, spec.head_dim),
            torch.zeros(N, S, spec.num_kv_heads, spec.head_dim),
        )
        for _ in range(spec.num_layers)
    ]
    return spec, model, caches


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_and_decode_match_hf(name: str, hf_model_dir) -> None:
    d = hf_model_dir(name)
    hf = load_hf(d)
    spec, model, caches = _ours(d)
    if name in ("mistral", "qwen3_sw"):
        assert any(
            model.layers[i].self_attn.attn.sliding_window == 8 for i in range(spec.num_layers)
        )
    if name == "qwen3_sw":
        assert model.layers[0].self_attn.attn.sliding_window is None
    assert hasattr(model, "lm_head") == (not spec.tie_word_embeddings)

    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, spec.vocab_size, (21,), generator=g)  # > sliding window 8
    blocks = torch.randperm(N, generator=g)[:12].tolist()  # scattered, non-contiguous blocks
    t = len(prompt)
    hidden = model(prompt, torch.arange(t), caches, _md(blocks, 0, t))
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (t, spec.vocab_size)
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0].float()
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[-1], ref[-1], atol=ATOL, rtol=1e-4)

    seq = prompt.tolist()
    for _ in range(5):  # decode: one token at a time through the cache vs HF on the full sequence
        nxt = int(logits[-1].argmax())
        seq.append(nxt)
        p = len(seq) - 1
        hidden = model(torch.tensor([nxt]), torch.tensor([p]), caches, _md(blocks, p, p + 1))
        logits = model.compute_logits(hidden)
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, -1].float()
        torch.testing.assert_close(logits[0], ref, atol=ATOL, rtol=1e-4)


def test_sliding_window_matters(hf_model_dir) -> None:
    """With a window of 8 and a 21-token prompt, full attention gives different logits."""
    spec, model, caches = _ours(hf_model_dir("mistral"))
    prompt = torch.arange(3, 24)
    blocks = list(range(8))
    a = model.compute_logits(model(prompt, torch.arange(21), caches, _md(blocks, 0, 21)))
    for layer in model.layers:
        layer.self_attn.attn.sliding_window = None
    b = model.compute_logits(model(prompt, torch.arange(21), caches, _md(blocks, 0, 21)))
    torch.testing.assert_close(a[:8], b[:8], atol=1e-5, rtol=1e-5)  # inside the window: same
    assert (a[8:] - b[8:]).abs().max() > 1e-2


def test_chunked_prefill_equals_single_pass(hf_model_dir) -> None:
    spec, model, caches = _ours(hf_model_dir("qwen2"))
    prompt = torch.arange(5, 28)
    blocks = [9, 3, 40, 1, 22, 17]
    full = model.compute_logits(model(prompt, torch.arange(23), caches, _md(blocks, 0, 23)))
    parts = []
    for a, b in [(0, 7), (7, 8), (8, 23)]:
        parts.append(
            model.compute_logits(model(prompt[a:b], torch.arange(a, b), caches, _md(blocks, a, b)))
        )
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=1e-5)


def test_load_weights_errors(hf_model_dir) -> None:
    spec, model, _ = _ours(hf_model_dir("llama"))
    good = dict(iter_canonical_weights(spec))
    with pytest.raises(ValueError, match="no parameter"):
        model.load_weights([("layers.0.bogus.weight", np.zeros(3, np.float32))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("norm.weight", np.zeros(3, np.float32))])
    partial = {k: v for k, v in good.items() if k != "norm.weight"}
    with pytest.raises(ValueError, match="missing.*norm.weight"):
        model.load_weights(partial.items())


def test_bf16_checkpoint_loads_and_tracks_hf(hf_model_dir) -> None:
    d = hf_model_dir("llama_bf16")
    spec = build_spec(d)
    assert spec.checkpoint_dtype == "bfloat16"
    model = get_model_class("llama")(spec, dtype=torch.bfloat16)
    model.load_weights(iter_canonical_weights(spec))
    hf = load_hf(d, torch.bfloat16)
    # Weights are bit-identical to HF's.
    assert torch.equal(model.embed_tokens.weight, hf.model.embed_tokens.weight)
    caches = [
        (
            torch.zeros(N, S, 2, 16, dtype=torch.bfloat16),
            torch.zeros(N, S, 2, 16, dtype=torch.bfloat16),
        )
        for _ in range(2)
    ]
    prompt = torch.arange(3, 15)
    logits = model.compute_logits(
        model(prompt, torch.arange(12), caches, _md(list(range(3)), 0, 12))
    )
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0].float()
    rel = (logits - ref).abs().max() / ref.abs().max()
    assert rel < 0.05, rel


def test_unknown_family_raises() -> None:
    with pytest.raises(ValueError, match="no model for family 'nope'.*llama"):
        get_model_class("nope")


def test_dummy_weights_shapes_and_scale(hf_model_dir) -> None:
    spec = build_spec(hf_model_dir("qwen2"))
    model = get_model_class("llama")(spec)
    model.init_dummy_weights(seed=3, std=0.02)
    w = model.layers[0].self_attn.qkv_proj.weight  # q, k, v fused along the output dim
    assert w.shape == (spec.q_size + 2 * spec.kv_size, spec.hidden_size)
    assert 0.015 < float(w.std()) < 0.025
    assert torch.all(model.norm.weight == 1.0)
    assert model.layers[0].self_attn.qkv_proj.bias is not None
