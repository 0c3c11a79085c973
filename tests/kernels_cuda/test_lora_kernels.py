"""Multi-LoRA shrink / expand (kernels_cuda/lora.py) against the torch references: mixed slots
(base tokens in between), fused-output offsets, ranks below the tile, under the Triton
interpreter on CPU (compiled on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xlaserve.kernels_cuda.lora import (
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
    lora_token_groups,
    lora_token_groups_np,
)


def test_token_groups_layout() -> None:
    packed = lora_token_groups_np(np.array([1, -1, 0, 1, -1, 0, 2]), 4)
    t = 7
    assert packed[:5].tolist() == [2, 5, 0, 3, 6]  # slot 0's tokens, slot 1's, slot 2's
    assert packed[t : t + 4].tolist() == [0, 2, 4, 5]  # starts
    assert packed[t + 4 :].tolist() == [2, 2, 1, 0]  # counts
    with pytest.raises(ValueError, match="out of range"):
        lora_token_groups_np(np.array([4]), 4)


@pytest.mark.parametrize(
    ("t", "k", "r", "n", "dtype"),
    [(7, 64, 8, 48, torch.float32), (37, 96, 16, 80, torch.float32), (5, 32, 4, 16, torch.float16)],
)
def test_shrink_expand_match_reference(t, k, r, n, dtype, device, tolerances) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(t * 31 + k)
    num_slots = 3
    x = torch.randn(t, k, generator=g).to(dtype).to(device)
    a = (torch.randn(num_slots, r, k, generator=g) * 0.3).to(dtype).to(device)
    b = (torch.randn(num_slots, n, r, generator=g) * 0.3).to(dtype).to(device)
    slots = torch.randint(-1, num_slots, (t,), generator=g).to(torch.int32)
    slots[0], slots[-1] = -1, 1
    slots = slots.to(device)
    groups = lora_token_groups(slots, num_slots)
    s = lora_shrink(x, a, groups)
    s_ref = lora_shrink_ref(x, a, slots)
    lora_rows = slots >= 0
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(
        s.sum(0)[lora_rows].cpu(), s_ref[lora_rows].cpu(), atol=atol * 10, rtol=rtol * 10
    )
    # Expand into the middle columns of a wider (fused) output; other columns untouched.
    width, off = n + 24, 8
    y = torch.randn(t, width, generator=g).to(dtype).to(device)
    y_ref = y.clone()
    lora_expand(s_ref.to(device), b, y, groups, y_offset=off)
    lora_expand_ref(s_ref.to(device), b, y_ref, slots, y_offset=off)
    torch.testing.assert_close(y.cpu().float(), y_ref.cpu().float(), atol=atol * 10, rtol=rtol * 10)
    base = ~lora_rows.cpu()
    assert torch.equal(y.cpu()[base], y_ref.cpu()[base])  # base tokens exactly unchanged


def test_stacked_shrink_with_offsets(device) -> None:  # noqa: ANN001
    """One shrink over A of two parts stacked along R, then one expand per part with s / y
    offsets (a fused gate_up output), equals two separate LoRA projections."""
    g = torch.Generator().manual_seed(3)
    t, k, r, n1, n2, num_slots = 9, 32, 4, 16, 24, 2
    x = torch.randn(t, k, generator=g).to(device)
    a1, a2 = (torch.randn(num_slots, r, k, generator=g).to(device) for _ in range(2))
    b1 = torch.randn(num_slots, n1, r, generator=g).to(device)
    b2 = torch.randn(num_slots, n2, r, generator=g).to(device)
    slots = torch.tensor([0, 1, -1, 0, 1, 1, -1, 0, 0], dtype=torch.int32, device=device)
    groups = lora_token_groups(slots, num_slots)
    s = lora_shrink(x, torch.cat([a1, a2], dim=1).contiguous(), groups)
    y = torch.zeros(t, n1 + n2, device=device)
    lora_expand(s, b1, y, groups, s_offset=0, y_offset=0)
    lora_expand(s, b2, y, groups, s_offset=r, y_offset=n1)
    want = torch.zeros(t, n1 + n2)
    lora_expand_ref(lora_shrink_ref(x, a1, slots), b1, want, slots.cpu(), 0, 0)
    lora_expand_ref(lora_shrink_ref(x, a2, slots), b2, want, slots.cpu(), 0, n1)
    torch.testing.assert_close(y.cpu(), want, atol=1e-4, rtol=1e-4)


def test_bad_shapes_raise(device) -> None:  # noqa: ANN001
    x = torch.zeros(2, 8, device=device)
    groups = lora_token_groups(torch.zeros(2, dtype=torch.int32, device=device), 1)
    with pytest.raises(ValueError, match="lora_shrink"):
        lora_shrink(x, torch.zeros(1, 4, 6, device=device), groups)
    with pytest.raises(ValueError, match="too small"):
        lora_expand(torch.zeros(2, 4, device=device), torch.zeros(1, 8, 4, device=device),
                    torch.zeros(2, 4, device=device), groups)  # fmt: skip


@pytest.mark.parametrize(("t", "k"), [(1, 1024), (3, 768), (20, 512)])
def test_split_k_shrink_partials_sum_to_the_reference(t, k, device) -> None:  # noqa: ANN001
    """Few tokens over a long K: the shrink slices K into S > 1 partials (a decode step), and
    the expand sums them; S = 1 (one slice over the whole K) gives the same sums."""
    from xlaserve.kernels_cuda.lora import shrink_splits

    num_slots, r, n = 4, 8, 40
    splits = shrink_splits(t, k, num_slots)
    assert splits > 1 and shrink_splits(16384, k, num_slots) == 1
    g = torch.Generator().manual_seed(t + k)
    x = torch.randn(t, k, generator=g).to(device)
    a = (torch.randn(num_slots, r, k, generator=g) * 0.1).to(device)
    b = (torch.randn(num_slots, n, r, generator=g) * 0.1).to(device)
    slots = torch.tensor([(i % (num_slots + 1)) - 1 for i in range(t)], dtype=torch.int32)
    slots[0] = 2
    slots = slots.to(device)
    groups = lora_token_groups(slots, num_slots)
    s = lora_shrink(x, a, groups)
    assert s.shape == (splits, t, r)
    lora_rows = (slots >= 0).cpu()
    s_ref = lora_shrink_ref(x.cpu(), a.cpu(), slots.cpu())
    # Each partial holds only its K slice: no single one equals the whole sum.
    assert not torch.allclose(s[0].cpu()[lora_rows], s_ref[lora_rows], atol=1e-3)
    torch.testing.assert_close(s.sum(0).cpu()[lora_rows], s_ref[lora_rows], atol=1e-4, rtol=1e-4)
    y = torch.randn(t, n, generator=g).to(device)
    y_ref = y.clone().cpu()
    lora_expand(s, b, y, groups)
    lora_expand_ref(s_ref, b.cpu(), y_ref, slots.cpu())
    torch.testing.assert_close(y.cpu(), y_ref, atol=1e-4, rtol=1e-4)
