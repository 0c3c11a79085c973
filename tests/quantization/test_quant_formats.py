"""Numpy quantizers, the int4 packing, GPTQ/AWQ/compressed-tensors packers and readers, and
QuantScheme detection. Hand-worked bit patterns first, then round trips against the originals."""

from __future__ import annotations

import numpy as np
import pytest

from xlaserve.quantization import (
    QuantScheme,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    int4_group_size,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    resolve_scheme,
    scheme_from_hf_config,
    unpack_int4,
)
from xlaserve.quantization.hf_formats import (
    awq_to_canonical,
    compressed_fp8_to_canonical,
    convert_prequantized,
    gptq_to_canonical,
    pack_awq,
    pack_gptq,
    quantize_compressed_fp8,
)

RNG = np.random.default_rng(0)


def test_int4_pack_by_hand() -> None:
    # group 4: byte j of a group holds channel j (low) and j + 2 (high).
    q = np.array([[1, 2, 3, 4, 5, 6, 7, 8]], np.uint8)
    p = pack_int4(q, 4)
    assert p.tolist() == [[0x31, 0x42, 0x75, 0x86]]
    assert unpack_int4(p, 4).tolist() == q.tolist()


def test_gptq_bits_by_hand() -> None:
    # One output column whose 8 input channels quantize to 8 + (0..7) - 8 ... : build q directly.
    k, n = 8, 8
    w = np.zeros((n, k), np.float32)
    w[0] = np.arange(8) - 8.0  # sym: s = 2*8/15, q = round(w/s) + 8
    t = pack_gptq(w, group_size=-1, sym=True, v1=True)
    s = 2 * 8 / 15
    q0 = np.clip(np.rint((np.arange(8) - 8.0) / np.float32(np.float16(s))) + 8, 0, 15).astype(int)
    expect = sum(int(v) << (4 * j) for j, v in enumerate(q0))
    assert int(t["qweight"].view(np.uint32)[0, 0]) == expect  # packed along K, low nibble first
    assert int(t["qzeros"].view(np.uint32)[0, 0]) == 0x77777777  # v1 stores zero - 1 = 7
    assert t["qweight"].shape == (1, 8) and t["scales"].shape == (1, 8)
    assert t["g_idx"].tolist() == [0] * 8


def test_awq_order_by_hand() -> None:
    # Row k=0 with q[n, 0] = n for n = 0..7: AWQ nibble i holds column AWQ_ORDER[i].
    from xlaserve.quantization.hf_formats import _pack_cols, _unpack_cols

    q = np.arange(8, dtype=np.uint8)[None, :]
    p = _pack_cols(q, (0, 2, 4, 6, 1, 3, 5, 7))
    assert int(p.view(np.uint32)[0, 0]) == 0x75316420
    assert _unpack_cols(p, (0, 2, 4, 6, 1, 3, 5, 7)).tolist() == q.tolist()


@pytest.mark.parametrize("k,g", [(256, 128), (192, 64), (64, 64)])
def test_quantizer_error_bounds(k: int, g: int) -> None:
    w = RNG.normal(size=(24, k)).astype(np.float32)
    q, s = quantize_int8(w)
    assert q.dtype == np.int8 and s.shape == (24,)
    assert np.all(np.abs(dequantize_int8(q, s) - w) <= s[:, None] / 2 + 1e-6)
    p, s4, z = quantize_int4(w, 128)
    assert p.shape == (24, k // 2) and s4.shape == (24, k // g) and z.max() <= 15
    err = np.abs(dequantize_int4(p, s4, z) - w).reshape(24, k // g, g)
    assert np.all(err <= s4[:, :, None] / 2 + 1e-5)
    q8, s8 = quantize_fp8(w)
    rel = np.abs(dequantize_fp8(q8, s8) - w) / s8[:, None]
    assert np.all(rel <= 448 / 16 + 1e-3)  # e4m3: 3 mantissa bits -> half-ulp <= 2^-4 * 448


def test_int4_group_rule() -> None:
    assert int4_group_size(4096) == 128
    assert int4_group_size(192) == 64
    assert int4_group_size(480) == 32
    assert int4_group_size(64) == 64
    assert int4_group_size(100) == 100  # no power-of-two divisor >= 32: one group per row


def _naive_gptq_dequant(t: dict, v1: bool) -> np.ndarray:
    """Bit-by-bit decoding of GPTQ tensors, element loops (independent of the vectorised code)."""
    qw, qz, sc, gi = (
        t["qweight"].view(np.uint32),
        t["qzeros"].view(np.uint32),
        t["scales"],
        t["g_idx"],
    )
    k, n = qw.shape[0] * 8, qw.shape[1]
    w = np.zeros((n, k), np.float32)
    for kk in range(k):
        for nn in range(n):
            q = (int(qw[kk // 8, nn]) >> (4 * (kk % 8))) & 15
            grp = int(gi[kk])
            z = ((int(qz[grp, nn // 8]) >> (4 * (nn % 8))) & 15) + (1 if v1 else 0)
            w[nn, kk] = (q - z) * float(sc[grp, nn])
    return w


def _naive_awq_dequant(t: dict, g: int) -> np.ndarray:
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    qw, qz, sc = t["qweight"].view(np.uint32), t["qzeros"].view(np.uint32), t["scales"]
    k, n = qw.shape[0], qw.shape[1] * 8
    w = np.zeros((n, k), np.float32)
    for kk in range(k):
        for c in range(n // 8):
            for i in range(8):
                nn = 8 * c + order[i]
                q = (int(qw[kk, c]) >> (4 * i)) & 15
                z = (int(qz[kk // g, c]) >> (4 * i)) & 15
                w[nn, kk] = (q - z) * float(sc[kk // g, nn])
    return w


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_reader_matches_naive_decoder(desc_act: bool) -> None:
    n, k, g = 16, 64, 16
    w = RNG.normal(size=(n, k)).astype(np.float32)
    perm = RNG.permutation(k) if desc_act else None
    t = pack_gptq(w, g, sym=True, perm=perm)
    ref = _naive_gptq_dequant(t, v1=True)
    assert np.abs(ref - w).max() < 0.5 * np.abs(w).max() / 7  # within half a 4-bit step
    c = gptq_to_canonical(t, QuantScheme("int4", "gptq", group_size=g, act_order=desc_act))
    got = dequantize_int4(c["qweight"], c["scales"], c["qzeros"])
    if desc_act:
        assert sorted(c["perm"].tolist()) == list(range(k))
        np.testing.assert_allclose(got, ref[:, c["perm"]], atol=1e-6)
    else:
        assert "perm" not in c
        np.testing.assert_allclose(got, ref, atol=1e-6)


def test_awq_reader_matches_naive_decoder() -> None:
    n, k, g = 16, 64, 32
    w = RNG.normal(size=(n, k)).astype(np.float32)
    t = pack_awq(w, g)
    assert t["qweight"].shape == (k, n // 8) and t["qzeros"].shape == (k // g, n // 8)
    ref = _naive_awq_dequant(t, g)
    c = awq_to_canonical(t, QuantScheme("int4", "awq", group_size=g))
    np.testing.assert_allclose(
        dequantize_int4(c["qweight"], c["scales"], c["qzeros"]), ref, atol=1e-6
    )
    assert np.abs(ref - w).max() <= float(t["scales"].max()) / 2 + 1e-3


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_fp8_reader(strategy: str) -> None:
    w = RNG.normal(size=(16, 32)).astype(np.float32)
    t = quantize_compressed_fp8(w, strategy)
    c = compressed_fp8_to_canonical(t)
    assert c["scales"].shape == (16,)
    back = dequantize_fp8(c["qweight"], c["scales"])
    assert np.abs(back - w).max() <= np.abs(w).max() * 2**-4 + 1e-6


def test_stream_groups_layers_and_passes_floats() -> None:
    w = RNG.normal(size=(16, 64)).astype(np.float32)
    t = pack_gptq(w, 32)
    pairs = [("layers.0.input_layernorm.weight", np.ones(64, np.float32))]
    pairs += [(f"layers.0.mlp.up_proj.{k}", v) for k, v in reversed(list(t.items()))]
    pairs += [("layers.0.mlp.up_proj.bias", np.zeros(16, np.float32))]
    out = dict(convert_prequantized(pairs, QuantScheme("int4", "gptq", group_size=32)))
    assert set(out) == {
        "layers.0.input_layernorm.weight",
        "layers.0.mlp.up_proj.qweight",
        "layers.0.mlp.up_proj.scales",
        "layers.0.mlp.up_proj.qzeros",
        "layers.0.mlp.up_proj.bias",
    }
    with pytest.raises(ValueError, match="lacks qweight, qzeros"):
        list(convert_prequantized(pairs[1:3], QuantScheme("int4", "gptq", group_size=32)))


def test_scheme_detection_and_errors(tmp_path) -> None:  # noqa: ANN001
    s = scheme_from_hf_config(
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
    )
    assert (s.method, s.source, s.act_order, s.gptq_v1) == ("int4", "gptq", True, True)
    s = scheme_from_hf_config(
        {"quant_method": "awq", "bits": 4, "version": "gemm", "group_size": 64}
    )
    assert (s.method, s.source, s.group_size) == ("int4", "awq", 64)
    with pytest.raises(NotImplementedError, match="bits=8"):
        scheme_from_hf_config({"quant_method": "gptq", "bits": 8})
    with pytest.raises(NotImplementedError, match="bitsandbytes"):
        scheme_from_hf_config({"quant_method": "bitsandbytes"})
    assert QuantScheme("int8").skips("lm_head") and not QuantScheme("int8").skips(
        "layers.0.mlp.up_proj"
    )
    assert QuantScheme("fp8", ignore=("re:.*down_proj",)).skips("layers.1.mlp.down_proj")
    assert resolve_scheme(None, str(tmp_path)) is None
    assert resolve_scheme("int4", str(tmp_path)).group_size == 128
    # A quantized KV cache leaves the weights' scheme alone; unknown values are rejected.
    assert resolve_scheme(None, str(tmp_path), kv_cache_dtype="fp8") is None
    assert resolve_scheme("int8", str(tmp_path), kv_cache_dtype="int8").method == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_scheme(None, str(tmp_path), kv_cache_dtype="int4")
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "awq"}}')
    with pytest.raises(ValueError, match="conflicts with the checkpoint"):
        resolve_scheme("int8", str(tmp_path))
    assert resolve_scheme("int4", str(tmp_path)).source == "awq"
