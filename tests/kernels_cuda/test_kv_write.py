"""write_kv: scatter by slot (block * S + offset), skip slot < 0; hand cases then a sweep."""

from __future__ import annotations

import pytest
import torch

from xlaserve.kernels_cuda.kv_write import write_kv, write_kv_ref

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_hand_slots_and_padding(device):
    # S = 4: slot 5 -> block 1 offset 1; slot -1 skipped; slot 0 -> block 0 offset 0.
    k = torch.arange(3 * 2 * 16, dtype=torch.float32).reshape(3, 2, 16).to(device) + 1
    v = -k
    kc = torch.zeros(3, 4, 2, 16, device=device)
    vc = torch.zeros_like(kc)
    write_kv(k, v, kc, vc, torch.tensor([5, -1, 0], dtype=torch.int32, device=device))
    torch.testing.assert_close(kc[1, 1], k[0])
    torch.testing.assert_close(vc[1, 1], v[0])
    torch.testing.assert_close(kc[0, 0], k[2])
    torch.testing.assert_close(vc[0, 0], v[2])
    written = torch.zeros(3, 4, dtype=torch.bool)
    written[1, 1] = written[0, 0] = True
    assert torch.all(kc[~written.to(device)] == 0)  # token 1 (padding) wrote nothing
    assert torch.all(vc[~written.to(device)] == 0)


@pytest.mark.parametrize(
    "t,hkv,d,page,dtype,cache_dtype",
    [
        (7, 2, 64, 4, torch.float32, torch.float32),
        (5, 3, 128, 16, torch.float16, torch.float16),
        (9, 1, 80, 8, torch.bfloat16, torch.bfloat16),
        (4, 2, 64, 4, torch.float32, torch.bfloat16),  # cast on write
    ],
)
def test_sweep_matches_reference(t, hkv, d, page, dtype, cache_dtype, device, equal_or_ulp):
    g = torch.Generator().manual_seed(t * d)
    n = 6
    slots = torch.randperm(n * page, generator=g)[:t].to(torch.int32)
    slots[::3] = -1  # every third token is padding
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    kc = torch.randn(n, page, hkv, d, generator=g).to(cache_dtype)
    vc = torch.randn(n, page, hkv, d, generator=g).to(cache_dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_ref(k, v, kc_ref, vc_ref, slots)
    kc, vc = kc.to(device), vc.to(device)
    write_kv(k.to(device), v.to(device), kc, vc, slots.to(device))
    equal_or_ulp(kc.cpu(), kc_ref)  # exact; fp32 -> bf16 cast may truncate under the interpreter
    equal_or_ulp(vc.cpu(), vc_ref)


def test_strided_k_v_views(device):
    # k and v as views of one fused [T, 2, Hkv, D] buffer (non-contiguous in dim 0).
    kv = torch.randn(5, 2, 2, 32, device=device)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([3, 0, 9, -5, 4], dtype=torch.int32, device=device)
    kc = torch.zeros(3, 4, 2, 32, device=device)
    vc = torch.zeros_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, slots)
    write_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_bad_arguments_raise(device):
    k = torch.zeros(2, 2, 16, device=device)
    kc = torch.zeros(2, 4, 2, 16, device=device)
    ok_slots = torch.tensor([0, 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="int32"):
        write_kv(k, k, kc, kc.clone(), ok_slots.long())
    with pytest.raises(ValueError, match="slots for"):
        write_kv(k, k, kc, kc.clone(), ok_slots[:1])
    with pytest.raises(ValueError, match="does not match cache"):
        write_kv(torch.zeros(2, 3, 16, device=device), torch.zeros(2, 3, 16, device=device),
                 kc, kc.clone(), ok_slots)  # fmt: skip


@pytest.mark.gpu
@gpu
def test_gpu_real_shapes():
    dev = torch.device("cuda")
    t, hkv, d, page, n = 4096, 8, 128, 16, 1024
    slots = torch.randperm(n * page, device=dev)[:t].to(torch.int32)
    slots[::7] = -1
    k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kc = torch.zeros(n, page, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, slots)
    write_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
