"""Decode fusions in the torch models, run by the Triton interpreter on CPU tensors:

- fused rope + KV write (DecoderAttention with the Triton rotary and a float cache): the same
  logits and cache bits as rotary + write_kv, for Llama, Qwen3 (qk-norm before rope) and Phi3
  (partial rotary), through a prefill and a decode step on the Triton attention backend; the
  switch off / a quantized cache keep the two kernels;
- the dense GEMV dispatch ($XLASERVE_DENSE_GEMV=1) in a bf16 model's decode step.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from arch_zoo import make_arch_model

from xlaserve.backends_torch.layers.attention import AttentionMetadata
from xlaserve.backends_torch.models import get_model_class
from xlaserve.model_loader.registry import build_spec, iter_canonical_weights

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)
IDS = [5, 17, 42, 99, 3, 250, 7]
PAGE = 4


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = make_arch_model(name, str(tmp_path_factory.mktemp(f"dec-{name}")))
        return cache[name]

    return get


def _model(path: str, dtype: torch.dtype = torch.float32):
    from xlaserve.backends_torch.attention_triton import TritonAttention

    spec = build_spec(path)
    model = get_model_class(spec.family)(spec, dtype=dtype, device="cpu",
                                         attn_backend=TritonAttention())  # fmt: skip
    model.load_weights(iter_canonical_weights(spec))
    model.set_triton_ops(True)
    return spec, model.eval()


def _md(q_lens: int, ctx: int, nblk: int) -> AttentionMetadata:
    """One sequence: its last q_lens tokens of a ctx-token context, slots ctx - q_lens.. ctx."""
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, q_lens], dtype=torch.int32),
        seq_lens=torch.tensor([ctx], dtype=torch.int32),
        block_tables=torch.arange(nblk, dtype=torch.int32)[None, :],
        slot_mapping=torch.arange(ctx - q_lens, ctx),
        max_query_len=q_lens,
        max_seq_len=ctx,
        query_start_loc_host=[0, q_lens],
        seq_lens_host=[ctx],
    )


def _prefill_and_decode(spec, model, kv_dtype=None):  # noqa: ANN001, ANN202
    """Logits of a prefill of IDS and of one decode step, and the caches after both."""
    n = len(IDS)
    nblk = -(-(n + 1) // PAGE)
    shape = (nblk, PAGE, spec.num_kv_heads, spec.head_dim)
    dt = next(model.parameters()).dtype
    if kv_dtype is None:
        caches = [(torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt))
                  for _ in range(spec.num_layers)]  # fmt: skip
    else:
        caches = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype),
                   torch.ones(shape[:3]), torch.ones(shape[:3]))
                  for _ in range(spec.num_layers)]  # fmt: skip
    h = model(torch.tensor(IDS), torch.arange(n), caches, _md(n, n, nblk))
    pre = model.compute_logits(h)
    h = model(torch.tensor([IDS[0]]), torch.tensor([n]), caches, _md(1, n + 1, nblk))
    return pre, model.compute_logits(h), caches


def _spy_fused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    import xlaserve.kernels_cuda as kc
    from xlaserve.kernels_cuda import rotary

    calls: list[int] = []
    real = rotary.rotary_embedding_write_kv

    def spy(q, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(kc, "rotary_embedding_write_kv", spy, raising=False)
    return calls


def _set_fused(model, on: bool) -> None:  # noqa: ANN001
    for layer in model.layers:
        layer.self_attn.fuse_rope_kv = on


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_fused_rope_kv_write_matches_two_kernels(arch_dir, arch, monkeypatch):  # noqa: ANN001
    spec, model = _model(arch_dir(arch))
    calls = _spy_fused(monkeypatch)
    assert all(layer.self_attn.fuse_rope_kv for layer in model.layers)  # default on
    pre, dec, caches = _prefill_and_decode(spec, model)
    assert calls == [len(IDS)] * spec.num_layers + [1] * spec.num_layers
    _set_fused(model, False)
    pre2, dec2, caches2 = _prefill_and_decode(spec, model)
    assert len(calls) == 2 * spec.num_layers  # the switch off: rotary + write_kv
    torch.testing.assert_close(pre, pre2, atol=0, rtol=0)
    torch.testing.assert_close(dec, dec2, atol=0, rtol=0)
    for (k, v), (k2, v2) in zip(caches, caches2, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    model.set_triton_ops(False)  # torch rotary + torch-side write: same model
    pre3, dec3, _ = _prefill_and_decode(spec, model)
    torch.testing.assert_close(dec, dec3, atol=1e-4, rtol=1e-4)


def test_fused_rope_kv_env_off_and_quantized_cache(arch_dir, monkeypatch):  # noqa: ANN001
    monkeypatch.setenv("XLASERVE_FUSED_ROPE_KV", "0")
    spec, model = _model(arch_dir("llama"))
    assert not any(layer.self_attn.fuse_rope_kv for layer in model.layers)
    monkeypatch.delenv("XLASERVE_FUSED_ROPE_KV")
    spec, model = _model(arch_dir("llama"))
    calls = _spy_fused(monkeypatch)
    _, dec_q, _ = _prefill_and_decode(spec, model, kv_dtype=torch.int8)
    assert calls == []  # quantized cache: the two kernels (write_kv quantizes)
    _, dec, _ = _prefill_and_decode(spec, model)
    torch.testing.assert_close(dec_q, dec, atol=0.05 * dec.abs().max().item(), rtol=0)


def test_dense_gemv_dispatch_in_bf16_decode(arch_dir, monkeypatch):  # noqa: ANN001
    from xlaserve.kernels_cuda import dense_gemv as dg

    spec, model = _model(arch_dir("llama"), torch.bfloat16)
    monkeypatch.setenv(dg.ENV_DENSE_GEMV, "0")
    _, ref, _ = _prefill_and_decode(spec, model)
    shapes: list[tuple[int, int]] = []
    real = dg.dense_gemv
    monkeypatch.setattr(
        dg, "dense_gemv", lambda x, w, b=None, **kw: shapes.append(w.shape) or real(x, w, b, **kw)
    )
    fused: list[tuple[int, int]] = []
    real_act = dg.dense_gemv_gate_act
    monkeypatch.setattr(
        dg,
        "dense_gemv_gate_act",
        lambda x, w, b, a, **kw: fused.append(w.shape) or real_act(x, w, b, a, **kw),
    )
    monkeypatch.setenv(dg.ENV_DENSE_GEMV, "1")
    for fuse_act in ("1", "0"):
        shapes.clear()
        fused.clear()
        monkeypatch.setenv(dg.ENV_GATE_ACT_GEMV, fuse_act)
        _, got, _ = _prefill_and_decode(spec, model)
        # decode only: qkv, o, gate_up, down per layer (gate_up with act-and-mul fused into its
        # epilogue, unless switched off), plus the lm head (prefill has M > 1).
        n_act = spec.num_layers if fuse_act == "1" else 0
        assert len(fused) == n_act and len(shapes) == 4 * spec.num_layers + 1 - n_act
        torch.testing.assert_close(got, ref, atol=0.05 * ref.abs().max().item(), rtol=0)
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
