"""Fused rotary + KV-cache write vs rotary_embedding_ref followed by write_kv_ref."""

from __future__ import annotations

import pytest
import torch

from xlaserve.kernels_cuda.rotary import (
    compute_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_write_kv,
    rotary_embedding_write_kv_ref,
)


def _inv_freq(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


def _case(t, hq, hkv, d, rotary_dim, dtype, slots, n_blocks=6, page=4, seed=0, fused_qkv=True):
    g = torch.Generator().manual_seed(seed + d + rotary_dim + t)
    if fused_qkv:  # q, k, v as strided views of one [T, (Hq + 2 Hkv) * D] projection output
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    else:
        q = torch.randn(t, hq, d, generator=g).to(dtype)
        k = torch.randn(t, hkv, d, generator=g).to(dtype)
        v = torch.randn(t, hkv, d, generator=g).to(dtype)
    pos = torch.randint(0, 64, (t,), generator=g)
    cache = compute_cos_sin_cache(_inv_freq(rotary_dim), 64)
    kc = torch.randn(n_blocks, page, hkv, d, generator=g).to(dtype)  # garbage must survive
    vc = torch.randn(n_blocks, page, hkv, d, generator=g).to(dtype)
    return q, k, v, pos, cache, kc, vc, torch.tensor(slots, dtype=torch.int32)


@pytest.mark.parametrize(
    "t,hq,hkv,d,rotary_dim,dtype,is_neox,slots",
    [
        (3, 4, 2, 64, 64, torch.float32, True, [5, 0, 23]),
        (4, 6, 2, 48, 32, torch.float16, True, [7, -1, 2, 12]),  # partial rotary, a padding slot
        (2, 2, 1, 80, 80, torch.bfloat16, True, [9, 1]),  # half = 40: not a power of two
        (3, 4, 4, 32, 16, torch.float32, False, [-1, 4, 3]),  # GPT-J, partial, padding first
        (1, 32, 8, 128, 128, torch.bfloat16, True, [17]),  # Llama-8B heads, batch-1 decode
    ],
)
def test_matches_two_references(t, hq, hkv, d, rotary_dim, dtype, is_neox, slots, device,
                                equal_or_ulp):  # fmt: skip
    q, k, v, pos, cache, kc, vc, sl = _case(t, hq, hkv, d, rotary_dim, dtype, slots)
    want = [x.clone() for x in (q, k, kc, vc)]
    rotary_embedding_write_kv_ref(want[0], want[1], v, pos, cache, want[2], want[3], sl, is_neox)
    q2, k2 = q.clone().to(device), k.clone().to(device)
    qd, kd, vd = (x.to(device) for x in (q, k, v))  # on CPU: the same tensors (in place)
    kcd, vcd = kc.to(device), vc.to(device)
    rotary_embedding_write_kv(
        qd, kd, vd, pos.to(device), cache.to(device), kcd, vcd, sl.to(device), is_neox
    )
    for got, ref in zip((qd, kd, kcd, vcd), want, strict=True):
        equal_or_ulp(got.cpu(), ref)
    # Same bits as the two Triton kernels it replaces (rotary then write_kv).
    rotary_embedding(q2, k2, pos.to(device), cache.to(device), is_neox)
    assert torch.equal(q2, qd) and torch.equal(k2, kd)


def test_int64_slots_and_untouched_cache(device):
    q, k, v, pos, cache, kc, vc, sl = _case(2, 2, 2, 32, 32, torch.float32, [3, -1])
    before = kc.clone()
    kcd, vcd = kc.to(device), vc.to(device)
    kd, vd = k.to(device), v.to(device)
    rotary_embedding_write_kv(
        q.to(device), kd, vd, pos.to(device), cache.to(device), kcd, vcd, sl.long().to(device)
    )
    flat = kcd.cpu().view(-1, 2, 32)
    assert torch.equal(flat[3], kd[0].cpu()) and torch.equal(vcd.cpu().view(-1, 2, 32)[3], v[0])
    others = [i for i in range(flat.shape[0]) if i != 3]
    assert torch.equal(flat[others], before.view(-1, 2, 32)[others])  # -1: nothing written


def test_rejects_quantized_cache_and_bad_slots(device):
    q, k, v, pos, cache, kc, vc, sl = _case(2, 2, 2, 32, 32, torch.float32, [0, 1])
    args = [x.to(device) for x in (q, k, v, pos, cache)]
    with pytest.raises(ValueError, match="k_scale"):
        rotary_embedding_write_kv(*args, kc.to(torch.int8), vc.to(torch.int8), sl)
    with pytest.raises(ValueError, match="int32/int64"):
        rotary_embedding_write_kv(*args, kc, vc, sl.float())
    with pytest.raises(ValueError, match="slots"):
        rotary_embedding_write_kv(*args, kc, vc, sl[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 300])
def test_gpu_llama8b_decode(t):
    dev = torch.device("cuda")
    hq, hkv, d, page, n = 32, 8, 128, 16, 256
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=torch.bfloat16)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device=dev).float() / d)
    cache = compute_cos_sin_cache(inv, 8192)
    pos = torch.randint(0, 8192, (t,), device=dev)
    slots = torch.randperm(n * page, device=dev)[:t].to(torch.int32)
    slots[0] = -1
    kc = torch.zeros(n, page, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    want = [x.clone() for x in (q, k, kc, vc)]
    rotary_embedding_write_kv_ref(want[0], want[1], v, pos, cache, want[2], want[3], slots)
    rotary_embedding_write_kv(q, k, v, pos, cache, kc, vc, slots)
    for got, ref in zip((q, k, kc, vc), want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-2, rtol=1e-2)
