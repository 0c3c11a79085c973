"""State-space decode kernels (kernels_cuda/ssm.py) against their torch references, in the
Triton interpreter on the CPU (compiled on a GPU): outputs and the in-place slot caches, with
fresh (keep = 0) and continuing requests, Mamba2 (scalar A per head, groups) and Mamba (P = 1,
per-channel A) shapes, and non-power-of-two sizes."""

from __future__ import annotations

import pytest
import torch

from xlaserve.kernels_cuda import ssm

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("c", "k"), [(24, 4), (37, 3)])
def test_conv_state_update_matches_reference(c: int, k: int) -> None:
    g = _g(c)
    S, B = 5, 3
    cache = torch.randn(S, c, k - 1, generator=g)
    x, w, b = (
        torch.randn(B, c, generator=g),
        torch.randn(c, k, generator=g),
        torch.randn(c, generator=g),
    )
    slots = torch.tensor([4, 0, 2])
    keep = torch.tensor([1.0, 0.0, 1.0])
    ref_cache = cache.clone()
    want = ssm.conv_state_update_ref(x, w, b, ref_cache, slots, keep)
    got_cache = cache.clone().to(DEV)
    got = ssm.conv_state_update(
        x.to(DEV), w.to(DEV), b.to(DEV), got_cache, slots.to(DEV), keep.to(DEV)
    )
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache.cpu(), ref_cache)  # untouched slots 1, 3 too
    torch.testing.assert_close(got_cache[1].cpu(), cache[1])


@pytest.mark.parametrize(("hs", "p", "n", "grp"), [(8, 16, 16, 2), (6, 5, 12, 3), (24, 1, 8, 1)])
def test_ssm_state_update_matches_reference(hs: int, p: int, n: int, grp: int) -> None:
    g = _g(hs + p + n)
    S, B = 4, 3
    cache = torch.randn(S, hs, p, n, generator=g)
    x = torch.randn(B, hs, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(B, hs, generator=g))
    if p == 1:  # Mamba: per-channel A [Hs, N]
        A = -torch.exp(torch.randn(hs, n, generator=g))
    else:  # Mamba2: one A per head, broadcast over N
        A = (-torch.exp(torch.randn(hs, 1, generator=g))).expand(hs, n)
    Bm, Cm = torch.randn(B, grp, n, generator=g), torch.randn(B, grp, n, generator=g)
    D = torch.randn(hs, generator=g)
    slots, keep = torch.tensor([1, 3, 0]), torch.tensor([0.0, 1.0, 1.0])
    ref_cache = cache.clone()
    want = ssm.ssm_state_update_ref(ref_cache, slots, keep, x, dt, A, Bm, Cm, D)
    got_cache = cache.clone().to(DEV)
    args = [t.to(DEV) for t in (slots, keep, x, dt, A, Bm, Cm, D)]
    got = ssm.ssm_state_update(got_cache, *args)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_cache.cpu(), ref_cache, rtol=1e-5, atol=1e-5)


def test_reference_matches_layer_ops() -> None:
    """The kernels' references agree with the model's ops (layers/ssm_ops.py)."""
    from xlaserve.backends_torch.layers import ssm_ops

    g = _g(7)
    hs, p, n, grp = 4, 3, 5, 2
    h0, x = torch.randn(2, hs, p, n, generator=g), torch.randn(2, hs, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(2, hs, generator=g))
    a = -torch.exp(torch.randn(hs, generator=g))
    Bm, Cm, D = (
        torch.randn(2, grp, n, generator=g),
        torch.randn(2, grp, n, generator=g),
        torch.randn(hs, generator=g),
    )
    cache = h0.clone()
    y = ssm.ssm_state_update_ref(cache, torch.tensor([0, 1]), torch.ones(2), x, dt,
                                 a[:, None].expand(hs, n), Bm, Cm, D)  # fmt: skip
    rep = hs // grp
    y2, h2 = ssm_ops.selective_state_update(
        h0, x, dt, a[:, None, None], Bm.repeat_interleave(rep, 1), Cm.repeat_interleave(rep, 1), D
    )
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(cache, h2)


@pytest.mark.parametrize(
    ("hs", "p", "n", "grp", "limit", "bsz"),
    [
        (8, 16, 16, 2, (0.0, float("inf")), 3),
        (6, 5, 12, 3, (0.05, 0.5), 3),
        (4, 64, 8, 1, (0.0, 2.0), 1),
    ],
)
def test_mamba2_state_update_matches_unfused_reference(
    hs: int, p: int, n: int, grp: int, limit: tuple[float, float], bsz: int
) -> None:
    """The fused launch (SiLU, softplus dt + clamp, A from A_log, update, D) equals the unfused
    ops; xc / dt_raw come as views of one wider row as the model passes them; batch 1 splits P."""
    g = _g(hs * p + n)
    S, i = 4, hs * p
    cache = torch.randn(S, hs, p, n, generator=g)
    proj = torch.randn(bsz, i + 2 * grp * n + hs + 3, generator=g)
    xc = proj[:, : i + 2 * grp * n].contiguous()
    dt_raw = proj[:, i + 2 * grp * n : i + 2 * grp * n + hs]  # strided view
    dt_bias, a_log, D = (torch.randn(hs, generator=g) for _ in range(3))
    dt_bias[0] = 30.0  # softplus's linear branch (threshold 20)
    slots, keep = torch.tensor([1, 3, 0][:bsz]), torch.tensor([0.0, 1.0, 1.0][:bsz])
    ref_cache = cache.clone()
    want = ssm.mamba2_state_update_ref(
        ref_cache, slots, keep, xc, dt_raw, dt_bias, a_log, D, grp, limit
    )
    got_cache = cache.clone().to(DEV)
    args = [t.to(DEV) for t in (slots, keep, xc)]
    dt_dev = proj.to(DEV)[:, i + 2 * grp * n : i + 2 * grp * n + hs]
    got = ssm.mamba2_state_update(
        got_cache, *args, dt_dev, dt_bias.to(DEV), a_log.to(DEV), D.to(DEV), grp, limit
    )
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_cache.cpu(), ref_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache[2].cpu(), cache[2])  # a slot of no request: untouched


@pytest.mark.parametrize(("i", "grp"), [(48, 1), (40, 4)])
def test_gated_rms_norm_matches_layer_op(i: int, grp: int) -> None:
    from xlaserve.backends_torch.layers import ssm_ops

    g = _g(i + grp)
    y = torch.randn(3, i, generator=g)
    proj = torch.randn(3, 2 * i, generator=g).to(torch.bfloat16)
    gate = proj[:, i:]  # strided view, as the model's z
    w = torch.randn(i, generator=g).to(torch.bfloat16)
    want = ssm_ops.gated_rms_norm(y, gate, w, grp, 1e-5)
    got = ssm.gated_rms_norm(y.to(DEV), proj.to(DEV)[:, i:], w.to(DEV), grp, 1e-5)
    assert got.dtype == torch.bfloat16
    # bf16 output rounded twice (as HF): one ulp apart on a GPU, two under the interpreter
    # (it truncates each cast).
    ulps = 1 if DEV == "cuda" else 2
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=ulps * 2.0**-7, atol=1e-6)
