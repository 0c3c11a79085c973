"""Parallel layers' sharding worked rank by rank in one process: each rank's layer is built under
a stand-in TP group (world size W, rank r) and the collectives are emulated by the test (sum for
all-reduce, concatenation for all-gather), so splits, KV-head replication (fewer KV heads than
ranks) and vocab padding are checked against the unsplit layer without spawning processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from xlaserve.backends_torch.distributed import layers as tpl
from xlaserve.backends_torch.distributed import parallel_state as ps


def _build(monkeypatch: pytest.MonkeyPatch, world: int, make):  # noqa: ANN001, ANN202
    """Build one layer per rank with `make()` under a stand-in group; collectives -> identity."""
    monkeypatch.setattr(tpl, "tp_all_reduce", lambda x: x)
    monkeypatch.setattr(tpl, "tp_all_gather", lambda x, dim=-1: x)
    out = []
    for r in range(world):
        monkeypatch.setattr(ps, "_TP", ps.TPGroup(r, world, None, None, "gloo"))  # type: ignore[arg-type]
        out.append(make())
    monkeypatch.setattr(ps, "_TP", None)
    return out


def _load(layer, full: dict[str, np.ndarray]) -> None:  # noqa: ANN001
    with torch.no_grad():
        for part, arr in full.items():
            getattr(layer, part).copy_(torch.from_numpy(layer.shard_array(part, arr).copy()))


def test_column_row_pair_matches_unsplit(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    h, inter, w = 8, 12, 4
    wu, bu = (
        rng.normal(size=(inter, h)).astype(np.float32),
        rng.normal(size=inter).astype(np.float32),
    )
    wd, bd = rng.normal(size=(h, inter)).astype(np.float32), rng.normal(size=h).astype(np.float32)
    x = torch.from_numpy(rng.normal(size=(5, h)).astype(np.float32))
    ref = F.linear(F.silu(F.linear(x, torch.from_numpy(wu), torch.from_numpy(bu))),
                   torch.from_numpy(wd), torch.from_numpy(bd))  # fmt: skip
    ups = _build(monkeypatch, w, lambda: tpl.ColumnParallelLinear(h, inter, True))
    downs = _build(monkeypatch, w, lambda: tpl.RowParallelLinear(inter, h, True))
    partial = []
    for up, down in zip(ups, downs, strict=True):
        assert up.weight.shape == (inter // w, h) and down.weight.shape == (h, inter // w)
        _load(up, {"weight": wu, "bias": bu})
        _load(down, {"weight": wd, "bias": bd})
        # Row-parallel adds its bias after the all-reduce: emulate by summing the bias-free part.
        partial.append(F.linear(F.silu(up(x)), down.weight))
    torch.testing.assert_close(sum(partial) + torch.from_numpy(bd), ref)


def test_kv_heads_replicated_when_fewer_than_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    d, hkv, w = 3, 2, 4  # 2 KV heads over 4 ranks: ranks (0, 1) hold head 0, (2, 3) head 1
    wk = np.arange(hkv * d * 5, dtype=np.float32).reshape(hkv * d, 5)
    ks = _build(monkeypatch, w, lambda: tpl.ColumnParallelLinear(5, hkv * d, False, replicas=2))
    heads = []
    for k in ks:
        _load(k, {"weight": wk})
        heads.append(k.weight.numpy())
    np.testing.assert_array_equal(heads[0], wk[:d])
    np.testing.assert_array_equal(heads[1], wk[:d])
    np.testing.assert_array_equal(heads[2], wk[d:])
    np.testing.assert_array_equal(heads[3], wk[d:])
    monkeypatch.setattr(ps, "_TP", ps.TPGroup(0, w, None, None, "gloo"))  # type: ignore[arg-type]
    assert ps.kv_heads_per_rank(hkv) == 1 and ps.kv_heads_per_rank(8) == 2


def test_vocab_parallel_embedding_and_logits_with_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    v, h, w = 10, 4, 4  # 10 rows over 4 ranks: 3 per rank, 2 padding rows on the last
    table = np.random.default_rng(1).normal(size=(v, h)).astype(np.float32)
    embs = _build(monkeypatch, w, lambda: tpl.VocabParallelEmbedding(v, h))
    heads = _build(monkeypatch, w, lambda: tpl.ParallelLMHead(v, h))
    ids = torch.tensor([0, 9, 3, 5, 2, 8])
    hidden = torch.from_numpy(np.random.default_rng(2).normal(size=(3, h)).astype(np.float32))
    emb_sum = 0
    for e, head in zip(embs, heads, strict=True):
        assert e.weight.shape == (3, h)
        _load(e, {"weight": table})
        _load(head, {"weight": table})
        emb_sum = emb_sum + e(ids)  # all-reduce: every id is embedded by exactly one rank
    torch.testing.assert_close(emb_sum, torch.from_numpy(table)[ids])
    assert torch.all(embs[3].weight[1:] == 0)  # padding rows
    # The all-gather concatenates [B, 3] pieces in rank order; padding columns are cut.
    gathered = torch.cat([F.linear(hidden, e.weight) for e in embs], dim=-1)[:, :v]
    torch.testing.assert_close(gathered, hidden @ torch.from_numpy(table).T)
    torch.testing.assert_close(heads[1](hidden), F.linear(hidden, heads[1].weight)[..., :v])
