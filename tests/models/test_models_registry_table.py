"""Architecture registry, expert stacking, MoE routing reference, and the README models table."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from arch_zoo import ARCHS

from xlaserve.model_loader import registry, table
from xlaserve.model_loader.spec import ModelSpec

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_models_table_is_current() -> None:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert table.START in text and table.END in text
    assert table.readme_section(text) == table.render_table(), (
        "README supported-models table is stale: run python -m xlaserve.model_loader.table"
    )


def test_table_lists_every_architecture_with_backend_support() -> None:
    rows = table.render_table().splitlines()[2:]
    assert len(rows) == len(registry.supported_architectures())
    torch_fams = table.backend_families("xlaserve.backends_torch.models")
    from xlaserve.backends_torch.models import supported_families

    assert torch_fams == set(supported_families())  # the AST read agrees with the import
    for arch in set(ARCHS.values()):
        row = next(r for r in rows if r.startswith(f"| `{arch}` |"))
        assert row.split("|")[3].strip() == "yes", row  # every tested arch is served by torch
    assert table.backend_families("xlaserve.no_such_backend") == set()


def test_replace_section_roundtrip() -> None:
    text = f"intro\n{table.START}\nold\n{table.END}\nrest\n"
    new = table.replace_section(text, "| a |")
    assert new == f"intro\n{table.START}\n| a |\n{table.END}\nrest\n"
    assert table.readme_section(new) == "| a |"
    with pytest.raises(ValueError, match="models:start"):
        table.replace_section("no markers", "x")


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ValueError) as e:
        registry.get_adapter("NopeForCausalLM")
    msg = str(e.value)
    assert "NopeForCausalLM" in msg
    for arch in ARCHS.values():
        assert arch in msg


def _moe_spec(**kw: object) -> ModelSpec:
    base = dict(
        architecture="X",
        family="moe",
        vocab_size=8,
        hidden_size=4,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=4,
        max_position_embeddings=16,
        num_experts=3,
    )
    return ModelSpec(**{**base, **kw})


def test_expert_slices_are_stacked_in_expert_order() -> None:
    spec = _moe_spec()
    w = {j: np.full((2, 4), j, np.float32) for j in range(3)}
    pairs = [("a", np.zeros(1))] + [
        (f"layers.0.mlp.experts.w_up{registry.EXPERT_SEP}{j}", w[j]) for j in (2, 0, 1)
    ]
    out = dict(registry._stack_experts(pairs, spec))
    assert set(out) == {"a", "layers.0.mlp.experts.w_up"}
    stacked = out["layers.0.mlp.experts.w_up"]
    assert stacked.shape == (3, 2, 4)
    assert [float(stacked[j, 0, 0]) for j in range(3)] == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="2 of 3 experts"):
        list(registry._stack_experts(pairs[:3], spec))


def test_fused_v5_expert_layout_is_split() -> None:
    gate_up = np.arange(3 * 4 * 2, dtype=np.float32).reshape(3, 4, 2)  # [E, 2I, H], I = 2
    out = dict(registry._moe_names("layers.0.mlp.experts.gate_up_proj", gate_up))
    np.testing.assert_array_equal(out["layers.0.mlp.experts.w_gate"], gate_up[:, :2])
    np.testing.assert_array_equal(out["layers.0.mlp.experts.w_up"], gate_up[:, 2:])


def test_select_experts_reference() -> None:
    from xlaserve.backends_torch.layers.moe import fused_experts_ref, select_experts

    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 4.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(w, p.gather(1, ids))
    w2, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(w2.sum(-1), torch.ones(2))
    # sigmoid + groups: group {0,1} vs {2,3}; with 1 group kept the top-2 come from one group.
    ws, ids_s = select_experts(
        logits, 2, True, "sigmoid", torch.zeros(4), num_groups=2, topk_groups=1, routed_scaling=2.0
    )
    assert sorted(ids_s[0].tolist()) == [0, 1] and sorted(ids_s[1].tolist()) == [2, 3]
    torch.testing.assert_close(ws.sum(-1), torch.full((2,), 2.0))
    # experts reference vs a dense loop
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, generator=g)
    wg, wu, wd = (
        torch.randn(4, 3, 4, generator=g),
        torch.randn(4, 3, 4, generator=g),
        torch.randn(4, 4, 3, generator=g),
    )
    got = fused_experts_ref(x, wg, wu, wd, w, ids)
    want = torch.stack(
        [
            sum(
                w[t, k] * (wd[e] @ (torch.nn.functional.silu(wg[e] @ x[t]) * (wu[e] @ x[t])))
                for k, e in enumerate(ids[t].tolist())
            )
            for t in range(2)
        ]
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_moe_impl_switch() -> None:
    from xlaserve.backends_torch.layers import moe

    assert "torch_ref" in moe.available_moe_impls()
    assert moe.get_moe_impl("torch_ref") is moe.fused_experts_ref
    with pytest.raises(ValueError, match="torch_ref"):
        moe.get_moe_impl("nope")
