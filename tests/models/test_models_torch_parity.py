"""Every supported architecture on the torch backend vs transformers (float32, tiny random weights).

For each architecture: (1) the last-position logits of a mixed-length batch run as ONE ragged
paged forward of our model equal HF's per-prompt logits within tolerance; (2) greedy tokens
through `xlaserve.LLM` (scheduler + paged cache, block_size 4) equal HF `generate` for the batch.
"""

from __future__ import annotations

import pytest
import torch
from arch_zoo import ARCHS, MAX_NEW, PROMPTS, S, hf_greedy, load_hf

from xlaserve.model_loader.registry import build_spec, iter_canonical_weights

NAMES = list(ARCHS)


def _ours(path: str):  # noqa: ANN202
    from xlaserve.backends_torch.models import get_model_class

    spec = build_spec(path)
    model = get_model_class(spec.family)(spec, dtype=torch.float32, device="cpu")
    model.load_weights(iter_canonical_weights(spec))
    return spec, model.eval()


def _ragged_last_logits(spec, model, prompts: list[list[int]]) -> torch.Tensor:  # noqa: ANN001
    """All prompts in one ragged forward over a paged cache -> last-position logits [B, V]."""
    from xlaserve.backends_torch.layers.attention import AttentionMetadata

    caches = [
        (
            torch.zeros(64, S, spec.num_kv_heads, spec.head_dim),
            torch.zeros(64, S, spec.num_kv_heads, spec.head_dim),
        )
        for _ in range(spec.num_layers)
    ]
    ids, pos, slots, qsl, tables = [], [], [], [0], []
    next_block = 1  # block 0 stays unused: catches block-table mistakes
    for p in prompts:
        nblk = -(-len(p) // S)
        blocks = list(range(next_block, next_block + nblk))[::-1]  # non-contiguous order
        next_block += nblk
        ids += p
        pos += range(len(p))
        slots += [blocks[i // S] * S + i % S for i in range(len(p))]
        qsl.append(qsl[-1] + len(p))
        tables.append(blocks)
    width = max(len(t) for t in tables)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        max_query_len=max(len(p) for p in prompts),
        max_seq_len=max(len(p) for p in prompts),
        query_start_loc_host=qsl,
        seq_lens_host=[len(p) for p in prompts],
    )
    hidden = model(torch.tensor(ids), torch.tensor(pos), caches, md)
    return model.compute_logits(hidden[torch.tensor(qsl[1:]) - 1])


@pytest.mark.parametrize("name", NAMES)
def test_arch_matches_transformers(name: str, arch_model_dir) -> None:
    from xlaserve import LLM, SamplingParams

    path = arch_model_dir(name)
    spec = build_spec(path)
    assert spec.architecture == ARCHS[name]
    hf = load_hf(path)

    # (1) logits of one ragged paged forward vs HF per prompt.
    _, model = _ours(path)
    ours = _ragged_last_logits(spec, model, PROMPTS)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in PROMPTS])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-4)

    # (2) greedy tokens through the whole engine vs HF generate.
    want = hf_greedy(hf, PROMPTS, MAX_NEW)
    assert len({t for seq in want for t in seq}) > 3, f"degenerate greedy output {want}"
    llm = LLM(path, backend="torch", dtype="float32", block_size=S, num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
