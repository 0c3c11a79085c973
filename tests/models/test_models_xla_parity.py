"""Every supported architecture on the XLA backend (Flax models) vs transformers (float32, tiny
random weights).

JAX compiles are slow on the CI machine (~10 s per jitted program), so the full engine runs for a
few architectures only; every architecture is checked at the model level, eagerly, over the same
ragged paged cache the engine uses:
(1) the last-position logits of a mixed-length batch run as ONE ragged paged forward equal HF's
    per-prompt logits within tolerance;
(2) greedy decoding with that model (batched decode steps over the paged cache) equals HF
    `generate` token for token.
Then `xlaserve.LLM(backend="xla")` (scheduler, chunked prefill, buckets, on-device sampler) gives
HF's greedy tokens for a soft-capped sliding-window model (Gemma2) and a MoE (Qwen2-MoE).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from arch_zoo import ARCHS, MAX_NEW, PROMPTS, S, hf_greedy, load_hf

from xlaserve.model_loader.registry import build_spec

WIDTH = 12  # block-table width: 48 tokens per request
NAMES = list(ARCHS)
ENGINE_NAMES = ["gemma2", "qwen2_moe"]  # each engine compiles ~5 programs: keep it to two


class _PagedBatch:
    """The prompts over a paged cache with non-contiguous, reversed block tables (block 0 unused)."""

    def __init__(self, spec, prompts: list[list[int]]) -> None:  # noqa: ANN001
        self.tables, nxt = [], 1
        for _ in prompts:
            self.tables.append(list(range(nxt, nxt + WIDTH))[::-1])
            nxt += WIDTH
        shape = (nxt, S, spec.num_kv_heads, spec.head_dim)
        self.caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(spec.num_layers)]

    def step(self, model, chunks: list[tuple[list[int], int]]) -> np.ndarray:  # noqa: ANN001
        """chunks = (new tokens, start position) per request -> last-token logits [B, V]."""
        from xlaserve.models_flax.attention import AttentionMetadata

        ids, pos, slots, cu = [], [], [], [0]
        for (toks, start), table in zip(chunks, self.tables, strict=True):
            p = np.arange(start, start + len(toks))
            ids += toks
            pos += p.tolist()
            slots += (np.asarray(table)[p // S] * S + p % S).tolist()
            cu.append(cu[-1] + len(toks))
        pad = 3  # padding tokens (slot -1) must be harmless
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots + [-1] * pad, jnp.int32),
            kv_lens=jnp.asarray([s + len(t) for t, s in chunks], jnp.int32),
            block_tables=jnp.asarray(self.tables, jnp.int32),
            cu_q_lens=jnp.asarray(cu, jnp.int32),
            num_seqs=jnp.asarray([len(chunks)], jnp.int32),
        )
        hidden, self.caches = model(
            jnp.asarray(ids + [0] * pad, jnp.int32),
            jnp.asarray(pos + [0] * pad, jnp.int32),
            self.caches,
            md,
        )
        return np.asarray(model.compute_logits(hidden[jnp.asarray(cu[1:]) - 1]))


def _flax_model(path: str):  # noqa: ANN202
    from flax import nnx
    from jax.sharding import Mesh

    from xlaserve.models_flax import get_model_class
    from xlaserve.models_flax.loader import load_model

    spec = build_spec(path)
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    model = nnx.merge(*load_model(spec, jnp.float32, mesh))
    assert isinstance(model, get_model_class(spec.family))
    return spec, model


@pytest.mark.parametrize("name", NAMES)
def test_flax_arch_matches_transformers(name: str, arch_model_dir) -> None:  # noqa: ANN001
    path = arch_model_dir(name)
    spec, model = _flax_model(path)
    assert spec.architecture == ARCHS[name]
    hf = load_hf(path)
    batch = _PagedBatch(spec, PROMPTS)
    with jax.default_matmul_precision("highest"):  # GPUs default to TF32 for float32 matmuls
        # (1) one ragged prefill of every prompt vs HF per prompt.
        logits = batch.step(model, [(p, 0) for p in PROMPTS])
        with torch.no_grad():
            ref = np.stack([hf(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS])
        np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=2e-4)
        # (2) greedy decode, all requests in each step, vs HF generate.
        want = hf_greedy(hf, PROMPTS, MAX_NEW)
        assert len({t for seq in want for t in seq}) > 3, f"degenerate greedy output {want}"
        got = [[int(t)] for t in logits.argmax(-1)]
        for _ in range(MAX_NEW - 1):
            chunks = [([g[-1]], len(p) + len(g) - 1) for p, g in zip(PROMPTS, got, strict=True)]
            for g, t in zip(got, batch.step(model, chunks).argmax(-1), strict=True):
                g.append(int(t))
    assert got == want


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_xla_engine_greedy_matches_transformers(
    name: str, arch_model_dir, tmp_path_factory: pytest.TempPathFactory
) -> None:  # noqa: ANN001
    from xlaserve import LLM, SamplingParams

    path = arch_model_dir(name)
    want = hf_greedy(load_hf(path), PROMPTS, MAX_NEW)
    llm = LLM(
        path,
        backend="xla",
        dtype="float32",
        block_size=S,
        num_kv_blocks=64,
        max_num_batched_tokens=32,  # the 4 prompts (38 tokens) need a chunked prefill
        max_num_seqs=4,
        max_model_len=64,
        compilation_cache_dir=str(tmp_path_factory.getbasetemp() / "xla-parity-jax-cache"),
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    llm.llm_engine.shutdown()
