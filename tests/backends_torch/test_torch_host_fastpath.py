"""Host fast paths of the torch backend (issue 7): the sampler's argmax-only path inside mixed
batches, the sum-based non-finite check and the numpy-built step metadata all give what the
plain definitions give."""

from __future__ import annotations

import numpy as np
import torch

from xlaserve.backends_torch.runner import TorchModelRunner, nonfinite_rows
from xlaserve.backends_torch.sampler import Sampler, SamplingRow, argmax_only
from xlaserve.config import CacheConfig, EngineConfig, LoadConfig, ModelConfig
from xlaserve.model_loader.registry import build_spec
from xlaserve.sampling_params import SamplingParams

V = 64


def _row(output: list[int] | None = None, **kw) -> SamplingRow:
    gen = kw.pop("generator", None)
    mask = kw.pop("bitmask", None)
    return SamplingRow(SamplingParams(**kw), [1, 2, 3], output or [], gen, mask)


def test_mixed_batch_each_row_matches_its_definition() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, V, generator=g) * 3
    eos = 7
    x[1, eos] = 50.0  # min_tokens row: EOS is the best token but masked
    x[2, eos] = 50.0  # same, min_tokens reached: plain argmax
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[10:20] = True
    packed = np.zeros(V // 32, dtype=np.int64)
    for t in range(10, 20):
        packed[t // 32] |= 1 << (t % 32)
    packed = packed.astype(np.uint32).view(np.int32)
    rows = [
        _row(temperature=0.0),  # 0 plain
        _row(output=[4], temperature=0.0, min_tokens=3, eos_token_ids=[eos]),  # 1
        _row(output=[4, 5, 6], temperature=0.0, min_tokens=3, eos_token_ids=[eos]),  # 2 plain
        _row(temperature=0.0, logit_bias={11: 40.0}),  # 3
        _row(temperature=1.0),  # 4 shared generator
        _row(temperature=0.0),  # 5 plain
        _row(temperature=0.8, top_k=5),  # 6 shared generator
        _row(temperature=0.0, logprobs=2),  # 7
        _row(temperature=0.0, bitmask=packed),  # 8
        _row(temperature=1.0, generator=torch.Generator().manual_seed(9)),  # 9 own generator
    ]
    assert [argmax_only(r) for r in rows] == [
        True,
        False,
        True,
        False,
        False,
        True,
        False,
        False,
        False,
        False,
    ]
    before = x.clone()
    out = Sampler(seed=5)(x, rows)
    assert torch.equal(x, before)  # raw logits untouched
    am = x.argmax(-1).tolist()
    for i in (0, 2, 5, 7):
        assert out.token_ids[i] == am[i]
    masked = x[1].clone()
    masked[eos] = float("-inf")
    assert out.token_ids[1] == int(masked.argmax()) != eos
    assert out.token_ids[3] == 11
    assert out.token_ids[8] == int(x[8].masked_fill(~allowed, float("-inf")).argmax())
    lp = torch.log_softmax(x[7], -1)
    e = out.logprobs[7]
    assert e is not None and e.token_ids[0] == am[7]
    assert abs(e.logprobs[0] - float(lp[am[7]])) < 1e-5
    assert all(out.logprobs[i] is None for i in range(10) if i != 7)
    # The shared generator draws only for the non-greedy rows, in order: the same tokens as a
    # batch of those rows alone; the seeded row follows its own generator.
    alone = Sampler(seed=5)(
        x[[4, 6, 9]],
        [rows[4], rows[6], _row(temperature=1.0, generator=torch.Generator().manual_seed(9))],
    )
    assert [out.token_ids[i] for i in (4, 6, 9)] == alone.token_ids


def test_all_plain_rows_low_precision_logits() -> None:
    x = (torch.randn(6, V, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    out = Sampler()(x, [_row(temperature=0.0, max_tokens=5) for _ in range(6)])
    assert out.token_ids == x.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_nonfinite_rows_matches_isfinite() -> None:
    x = torch.randn(8, V, generator=torch.Generator().manual_seed(2))
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, 9] = float("-inf")
    x[4, 1], x[4, 2] = float("inf"), float("-inf")
    x[5, :] = 3.0e38  # finite, but the row sum overflows
    x[6, :8] = -3.0e38
    suspect = (~torch.isfinite(x.sum(dim=-1))).tolist()
    assert suspect[5] and suspect[6]  # the sum is fooled ...
    want = {r for r in range(8) if not bool(torch.isfinite(x[r]).all())}
    assert want == {1, 2, 3, 4}
    assert nonfinite_rows(x, suspect) == want  # ... the exact re-check is not
    assert nonfinite_rows(x, [False] * 8) == set()


def _reference_inputs(
    chunks: list[tuple[list[int], int, list[int]]], S: int
) -> tuple[list[int], list[int], list[int], list[int], list[int], list[list[int]]]:
    ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
    for toks, start, table in chunks:
        end = start + len(toks)
        ids += toks
        pos += list(range(start, end))
        slots += [table[p // S] * S + p % S for p in range(start, end)]
        qsl.append(qsl[-1] + len(toks))
        seq_lens.append(end)
    m = max(len(t) for _, _, t in chunks)
    tables = [t + [0] * (m - len(t)) for _, _, t in chunks]
    return ids, pos, slots, qsl, seq_lens, tables


def test_build_inputs_matches_python_reference(hf_model_dir) -> None:
    d = hf_model_dir("llama")
    S = 4
    cfg = EngineConfig(
        model=ModelConfig(model=d, dtype="float32"),
        cache=CacheConfig(block_size=S, num_kv_blocks=64),
        load=LoadConfig(load_format="dummy"),
    )
    runner = TorchModelRunner(cfg, build_spec(d))
    rng = np.random.default_rng(0)
    perm = rng.permutation(64).tolist()
    decode = [
        ([int(rng.integers(300))], s, perm[i * 6 : i * 6 + s // S + 1])
        for i, s in enumerate((3, 8, 13))
    ]
    mixed = [
        (rng.integers(300, size=9).tolist(), 0, perm[20:23]),  # prefill from 0
        ([5], 10, perm[23:26]),  # decode
        (rng.integers(300, size=6).tolist(), 4, perm[26:29]),  # chunk after a prefix hit
    ]
    for chunks in (decode, mixed):
        ids, pos, md = runner._build_inputs(chunks)
        r_ids, r_pos, r_slots, r_qsl, r_lens, r_tables = _reference_inputs(chunks, S)
        assert ids.tolist() == r_ids and ids.dtype == torch.long
        assert pos.tolist() == r_pos and pos.dtype == torch.long
        assert md.slot_mapping.tolist() == r_slots and md.slot_mapping.dtype == torch.long
        assert md.query_start_loc.tolist() == r_qsl == md.query_start_loc_host
        assert md.seq_lens.tolist() == r_lens == md.seq_lens_host
        assert md.block_tables.tolist() == r_tables and md.block_tables.dtype == torch.int32
        assert md.query_start_loc.dtype == md.seq_lens.dtype == torch.int32
        assert md.max_query_len == max(len(c[0]) for c in chunks)
        assert md.max_seq_len == max(r_lens)


def test_cached_row_flags_equal_the_step_rules() -> None:
    """The runner's per-request constants (defer_ok, stop_mask_until, cached at admission)
    decide each step's rows as sampler.deferrable_step / argmax_only_step do, for every
    output length around min_tokens and every kind of request."""
    from xlaserve.backends_torch.sampler import (
        argmax_only_step,
        defer_ok,
        deferrable_step,
        is_plain_greedy,
        stop_mask_until,
    )

    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, min_tokens=3),  # EOS masked for 3 tokens
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),  # nothing to mask
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[7]),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
        SamplingParams(temperature=0.0, bad_words=["x"]),
    ]
    for p in kinds:
        p.eos_token_ids = {2}  # the engine sets it from the model
        until, ok, greedy = stop_mask_until(p), defer_ok(p), is_plain_greedy(p)
        for n in range(6):
            masked = n < until
            assert masked == p.masks_stop_tokens(n), (p, n)
            assert (ok and not masked) == deferrable_step(p, n, has_bitmask=False), (p, n)
            for bm in (False, True):
                want = argmax_only_step(p, greedy, n, bm)
                assert (greedy and not masked and not bm) == want, (p, n, bm)
