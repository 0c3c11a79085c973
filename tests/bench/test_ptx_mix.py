"""bench/gpu_probes/ptx_mix.py compiles kernel variants for sm_90 ahead of time (no GPU) and counts
their opcodes. Pinned here: the fp16 dots over an fp8 KV cache drop the f16 -> f32 -> bf16
converts and most fp32 multiplies of the bf16-dot version (kernels_cuda/paged_attention.py's
QUANT_F16_DOTS comment), keeping the one e4m3 -> f16x2 convert per two codes. Compiled in a
subprocess without TRITON_INTERPRET (the tests' conftest sets it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from optional_deps import import_or_skip

import_or_skip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_opcode_mix_counts_inline_asm_and_predicated() -> None:
    from bench.gpu_probes.ptx_mix import opcode_mix

    ptx = ("\t.reg .b32 %r<4>;\n$L__BB0_1:\n\tmul.f32 %f1, %f2, %f3;\n"
           "\t@%p1 bra $L__BB0_1;\n{\ncvt.rn.f16x2.e4m3x2 %r1, %rs1;\n}\n"
           "\tmbarrier.try_wait.parity.shared::cta.b64 %p2, [%r2], %r3;\n\tret;\n")  # fmt: skip
    assert opcode_mix(ptx) == {"mul.f32": 1, "bra": 1, "cvt.rn.f16x2.e4m3x2": 1, "ret": 1,
                               "mbarrier.try_wait.parity.shared::cta.b64": 1}  # fmt: skip


def test_fp8_attention_fp16_dots_mix(tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "mix.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu_probes", "ptx_mix.py"),
         "--groups", "attention", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode and "ASTSource" in proc.stderr:
        pytest.skip("this Triton has no ahead-of-time compile API")
    assert proc.returncode == 0, proc.stderr[-3000:]
    att = json.loads(out.read_text())["attention"]
    for bn in (64, 128):
        bf, f16 = att[f"fp8_bf16_dots BLOCK_N={bn}"], att[f"fp8_fp16_dots BLOCK_N={bn}"]
        assert bf.get("cvt.f32.f16", 0) > 0 and f16.get("cvt.f32.f16", 0) == 0, bn
        assert bf.get("cvt.rn.bf16x2.f32", 0) > 0 and f16.get("cvt.rn.bf16x2.f32", 0) == 0, bn
        assert f16["mul.f32"] < bf["mul.f32"] / 2, bn
        assert f16["cvt.rn.f16x2.e4m3x2"] == bf["cvt.rn.f16x2.e4m3x2"] > 0, bn
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in f16, bn
        assert att[f"bf16 BLOCK_N={bn}"].get("cvt.rn.f16x2.e4m3x2", 0) == 0, bn


def _mix(tmp_path, name: str, *extra: str) -> dict:  # noqa: ANN001
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu_probes", "ptx_mix.py"),
         "--groups", "int8_mm", "--out", str(out), *extra],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode and "ASTSource" in proc.stderr:
        pytest.skip("this Triton has no ahead-of-time compile API")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["int8_mm"]


def test_kernels_from_another_checkout(tmp_path) -> None:  # noqa: ANN001
    """`--kernels-from DIR` compiles DIR/kernels_cuda's quant_matmul.py, not the installed one:
    a copy whose int8 kernel adds 1 to its output before the store compiles to another mix
    (the scale multiply becomes an fma), and an unchanged copy to the installed module's."""
    src = open(os.path.join(ROOT, "kernels_cuda", "quant_matmul.py")).read()
    store = "        out.to(y_ptr.dtype.element_ty),\n        mask=(rm[:, None] < M)"
    assert src.count(store) == 1
    (tmp_path / "same" / "kernels_cuda").mkdir(parents=True)
    (tmp_path / "same" / "kernels_cuda" / "quant_matmul.py").write_text(src)
    (tmp_path / "plus1" / "kernels_cuda").mkdir(parents=True)
    (tmp_path / "plus1" / "kernels_cuda" / "quant_matmul.py").write_text(
        src.replace(store, store.replace("out.to(", "(out + 1.0).to("))
    )
    base = _mix(tmp_path, "base")
    assert _mix(tmp_path, "same", "--kernels-from", str(tmp_path / "same")) == base
    plus1 = _mix(tmp_path, "plus1", "--kernels-from", str(tmp_path / "plus1"))
    for variant, mix in base.items():
        assert plus1[variant] != mix, variant
        assert plus1[variant].get("fma.rn.f32", 0) > mix.get("fma.rn.f32", 0), variant
