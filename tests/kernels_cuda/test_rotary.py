"""rotary_embedding (in place): hand cases, HF rotate_half parity, sweep vs the reference."""

from __future__ import annotations

import math

import pytest
import torch

from xlaserve.kernels_cuda.rotary import (
    compute_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_ref,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inv_freq(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


def test_hand_quarter_turn_and_identity(device):
    # One pair (rotary_dim 2) with angle = pi/2 * position: (1, 0) -> position 0: (1, 0),
    # position 1: (cos, sin) = (0, 1). Dims past rotary_dim (here 2..15) pass through.
    cache = compute_cos_sin_cache(torch.tensor([math.pi / 2]), 4).to(device)
    q = torch.zeros(2, 1, 16)
    q[:, 0, 0] = 1.0
    q[:, 0, 2:] = 5.0
    k = q.clone()
    qd, kd = q.to(device), k.to(device)
    rotary_embedding(qd, kd, torch.tensor([0, 1], device=device), cache)
    expected = q.clone()
    expected[1, 0, 0], expected[1, 0, 1] = 0.0, 1.0
    torch.testing.assert_close(qd.cpu(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(kd.cpu(), expected, atol=1e-6, rtol=0)


def test_matches_hf_rotate_half(device):
    # transformers' Llama apply_rotary_pos_emb (neox pairing) on [B, H, T, D] with cos/sin [B, T, D].
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t, hq, hkv, d = 5, 4, 2, 32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    pos = torch.tensor([0, 3, 7, 8, 20])
    inv = _inv_freq(d)
    freqs = torch.outer(pos.float(), inv)
    emb = torch.cat([freqs, freqs], -1)
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    qd, kd = q.to(device), k.to(device)
    rotary_embedding(qd, kd, pos.to(device), compute_cos_sin_cache(inv, 32).to(device))
    torch.testing.assert_close(qd.cpu(), q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kd.cpu(), k_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "t,hq,hkv,d,rotary_dim,dtype,is_neox",
    [
        (4, 4, 2, 64, 64, torch.float32, True),
        (3, 6, 2, 128, 64, torch.float16, True),  # partial rotary
        (5, 2, 1, 80, 80, torch.bfloat16, True),  # half = 40: not a power of two
        (4, 4, 4, 64, 32, torch.float32, False),  # GPT-J interleaved, partial
    ],
)
def test_sweep_matches_reference(t, hq, hkv, d, rotary_dim, dtype, is_neox, device, tolerances):
    g = torch.Generator().manual_seed(d + rotary_dim)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    pos = torch.randint(0, 64, (t,), generator=g, dtype=torch.int64)
    cache = compute_cos_sin_cache(_inv_freq(rotary_dim), 64)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(q_ref, k_ref, pos, cache, is_neox)
    qd, kd = q.to(device), k.to(device)
    rotary_embedding(qd, kd, pos.to(device).to(torch.int32), cache.to(device), is_neox)
    atol, rtol = tolerances[dtype]
    torch.testing.assert_close(qd.cpu().float(), q_ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(kd.cpu().float(), k_ref.float(), atol=atol, rtol=rtol)
    # the pass-through dims are untouched bit for bit
    assert torch.equal(qd.cpu()[..., rotary_dim:], q[..., rotary_dim:])


def test_views_of_fused_qkv(device):
    # q and k as column slices of one [T, (Hq + 2 Hkv) * D] projection output.
    t, hq, hkv, d = 3, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=device)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    q_ref, k_ref = q.cpu().clone(), k.cpu().clone()
    pos = torch.tensor([1, 2, 9])
    cache = compute_cos_sin_cache(_inv_freq(d), 16)
    rotary_embedding_ref(q_ref, k_ref, pos, cache)
    rotary_embedding(q, k, pos.to(device), cache.to(device))
    torch.testing.assert_close(q.cpu(), q_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(k.cpu(), k_ref, atol=2e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)


def test_bad_arguments_raise(device):
    q = torch.zeros(2, 4, 16, device=device)
    k = torch.zeros(2, 2, 16, device=device)
    cache = torch.zeros(8, 16, device=device)
    with pytest.raises(ValueError, match="positions must be"):
        rotary_embedding(q, k, torch.zeros(3, dtype=torch.int64, device=device), cache)
    with pytest.raises(ValueError, match="int32/int64"):
        rotary_embedding(q, k, torch.zeros(2, device=device), cache)
    with pytest.raises(ValueError, match="rotary_dim 32 > head_dim 16"):
        rotary_embedding(q, k, torch.zeros(2, dtype=torch.int32, device=device),
                         torch.zeros(8, 32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="k dtype"):
        rotary_embedding(q, k.half(), torch.zeros(2, dtype=torch.int32, device=device), cache)


@pytest.mark.gpu
@gpu
def test_gpu_real_shapes(tolerances):
    dev = torch.device("cuda")
    t, hq, hkv, d = 2048, 32, 8, 128
    q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (t,), device=dev)
    cache = compute_cos_sin_cache(_inv_freq(d, 500000.0).to(dev), 8192)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(q_ref, k_ref, pos, cache)
    rotary_embedding(q, k, pos, cache)
    atol, rtol = tolerances[torch.bfloat16]
    torch.testing.assert_close(q.float(), q_ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(k.float(), k_ref.float(), atol=atol, rtol=rtol)
