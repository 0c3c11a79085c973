"""The large-M quantized GEMMs build for an H200 (sm_90) without one: Triton compiles them ahead
of time to PTX and cubin here (its bundled ptxas), with the alignment the launcher gets at run
time (pointers, strides, N and K divisible by 16). Checked: the tensor-core path is Hopper's
wgmma and the K loop is software-pipelined (cp.async copies, several stages of shared memory),
which the CPU interpreter cannot show. Compiled in a subprocess without TRITON_INTERPRET (this
folder's conftest sets it, and Triton decides at decoration time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from optional_deps import import_or_skip

import_or_skip("torch")
import_or_skip("triton")

SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from xlaserve.kernels_cuda import quant_matmul as qm
from xlaserve.kernels_cuda import scaled_mm as sm

def build(fn, sig, consts, warps, stages):
    names = fn.arg_names
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in sig
               if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K", "K_SPLIT")}
    src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})

def one(kind):
  split = kind.endswith("_split")  # split-K: fp32 partials into a workspace
  kind = kind.removesuffix("_split")
  y = "*fp32" if split else "*bf16"
  if kind.startswith("int8_weight_only"):
      bm, bn, bk, gm, warps, stages, swap = qm.int8_dot_tiles(1 << 20)[:7]
      if kind.endswith("swap") != swap:  # the other operand order, same tiles
          swap = not swap
      sig = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "y_ptr": y, "M": "i32",
             "N": "i32", "K": "i32", "K_SPLIT": "i32", "stride_xm": "i32", "stride_wn": "i32",
             "stride_ys": "i32", "stride_ym": "i32"}
      k = build(qm._int8_mm_kernel, sig, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                UPCAST=False, SWAP_AB=swap, SPLIT=split), warps, stages)
      stage_bytes = bm * bk * 2 + bk * bn  # a bf16 x tile and an int8 weight tile
  else:
      fmt = "int8" if kind == "int8" else "fp8"
      t = sm.scaled_mm_tiles(fmt, 1 << 20)
      code = "*i8" if fmt == "int8" else "*fp8e4nv"  # fp8 goes in typed on a GPU
      wb = 128 if kind == "fp8_block" else 0
      sig = {"a_ptr": code, "b_ptr": code, "as_ptr": "*fp32", "bs_ptr": "*fp32",
             "bias_ptr": "*bf16", "y_ptr": y, "M": "i32", "N": "i32", "K": "i32",
             "K_SPLIT": "i32", "stride_am": "i32", "stride_bn": "i32", "stride_bsn": "i32",
             "stride_ys": "i32", "stride_ym": "i32"}
      consts = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                    INT_ACC=fmt == "int8", WB_N=wb, WB_K=wb, HAS_BIAS=True, FP8_BITS=False,
                    UPCAST=False, SPLIT=split)
      k = build(sm._scaled_mm_kernel, sig, consts, t.num_warps, t.num_stages)
      stage_bytes = (t.block_m + t.block_n) * t.block_k  # two 8-bit tiles
  ptx = k.asm["ptx"]
  wg = re.search(r"wgmma\.mma_async\S*\s+\{[^}]*\},\s*(\S)", ptx)
  return {"wgmma": "wgmma.mma_async" in ptx, "cp_async": "cp.async" in ptx,
          "shared": k.metadata.shared, "stage_bytes": stage_bytes,
          "a_from_registers": bool(wg and wg.group(1) == "{"),
          "st_shared": len(re.findall(r"^\s*st\.shared", ptx, re.M)),
          "ld_shared": len(re.findall(r"^\s*ld\.shared", ptx, re.M)),
          "ldmatrix": len(re.findall(r"^\s*ldmatrix", ptx, re.M))}

print(json.dumps({kind: one(kind) for kind in sys.argv[1:]}))
"""


KINDS = (
    "int8", "fp8", "fp8_block", "int8_weight_only", "int8_weight_only_swap",
    "int8_split", "fp8_block_split", "int8_weight_only_split",  # split-K (SPLIT) variants
)  # fmt: skip


@pytest.fixture(scope="module")
def builds() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *KINDS], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    if proc.returncode and "ImportError" in proc.stderr and "ASTSource" in proc.stderr:
        pytest.skip("this Triton has no ahead-of-time compile API")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", KINDS)
def test_large_m_tiles_build_pipelined_wgmma(builds: dict, kind: str) -> None:
    got = builds[kind]
    assert got["wgmma"], got  # Hopper tensor cores
    assert got["cp_async"], got  # the K loop's loads are asynchronous copies
    # Several stages of the K loop in shared memory (unpipelined: exactly one).
    assert got["shared"] >= 2 * got["stage_bytes"], got


def test_int8_weight_only_operand_order(builds: dict) -> None:
    """The reason for swap_ab (quant_matmul.INT8_DOT_TILES' comment): in the plain order the
    converted int8 weight is wgmma's shared-memory B operand, so every K step stores it back to
    shared memory; swapped, it is the register A operand and the K loop stores nothing."""
    plain, swap = builds["int8_weight_only"], builds["int8_weight_only_swap"]
    assert not plain["a_from_registers"] and plain["st_shared"] >= 4, plain
    assert swap["a_from_registers"] and swap["st_shared"] <= 1, swap


def test_fp8_gemm_loop_matches_int8(builds: dict) -> None:
    """The fp8 w8a8 GEMM's operands go in as fp8 (`scaled_mm`): its K loop then moves nothing
    through registers, like the int8 one. (Loaded as uint8 and bitcast in the loop, each tile
    went shared memory -> registers -> shared memory before wgmma: 4 ld.shared, 12 st.shared
    and 12 ldmatrix against int8's 0 / 8 / 8, and 0.76x bf16 against int8's 1.37x with the
    same tiles, H100, bench/RESULTS.md.)"""
    import torch

    from xlaserve.kernels_cuda.scaled_mm import kernel_operands

    x8 = torch.zeros(2, 16, dtype=torch.float8_e4m3fn)
    a, b, bits = kernel_operands(x8, x8, interp=False)  # what a GPU launch passes
    assert a.dtype == b.dtype == torch.float8_e4m3fn and not bits
    assert kernel_operands(x8, x8, interp=True)[2]  # the interpreter: uint8 bits
    i8, f8 = builds["int8"], builds["fp8"]
    assert f8["ld_shared"] == i8["ld_shared"] == 0, (i8, f8)
    assert f8["st_shared"] == i8["st_shared"] and f8["ldmatrix"] == i8["ldmatrix"], (i8, f8)
