#!/usr/bin/env python
"""The sm_90 PTX instruction mix of kernel variants, compiled ahead of time on any host (Triton's
`triton.compile` with its bundled ptxas; no GPU, no TRITON_INTERPRET), with the launch
specialisations the engine's calls get (pointers and strides divisible by 16). A structural
check, not a speed figure: how many converts, multiplies, shared-memory loads / stores and which
mma form each variant emits.

Groups (``--groups``):
- ``attention``: one decode tile of the unified attention kernel (8B shape: G 4, head 128,
  16-token pages, 16 splits) over a bf16 cache, an fp8 cache with bf16 dots, and an fp8 cache
  with fp16 dots (QUANT_F16), at BLOCK_N 64 (3 stages) and 128 (4 stages);
- ``attention_prefill``: a prefill tile of the same kernel (bf16 cache), for its mma form: the
  table's launch config and the wide one an sm_90 GPU takes (`PREFILL_WIDE_CONFIGS`);
- ``int8_mm``: the int8 weight-only tl.dot kernel, plain and swapped operand order, at the
  table's large-M tiles;
- ``scaled_mm``: the w8a8 GEMM at the table's large-M tiles: int8, fp8 with typed operands (as
  launched on a GPU) and fp8 as uint8 bits bitcast in the K loop (the interpreter's form, and
  the GPU's before `scaled_mm.kernel_operands`);
- ``ssm``: the Mamba / Mamba2 decode state updates;
- ``act_quant``: the fused RMSNorm / SiLU-and-mul activation quantization kernels.

    python bench/gpu_probes/ptx_mix.py --groups attention --ops cvt.f32.f16 mul.f32
    git worktree add /tmp/old REV && python bench/gpu_probes/ptx_mix.py --groups int8_mm \
        scaled_mm --kernels-from /tmp/old    # the same GEMM variants as compiled at REV
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
from typing import Any

GROUPS = ("attention", "attention_prefill", "int8_mm", "scaled_mm", "ssm", "act_quant")


def _compile(fn: Any, sig: dict[str, str], consts: dict[str, Any], warps: int = 4,  # noqa: ANN401
             stages: int = 3) -> str:  # fmt: skip
    """fn's sm_90 PTX: sig names the typed arguments, consts the constexprs; pointers, stride_*
    arguments, N, K and K_SPLIT are declared divisible by 16, as Triton's launcher specializes
    them at run time on the model's shapes (without it the K-masked loads of a GEMM do not vectorize
    or go through cp.async, which is not the code a GPU runs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    # Arguments fn lacks are dropped (an older kernel, `--kernels-from`).
    sig = {n: v for n, v in sig.items() if n in names}
    consts = {n: v for n, v in consts.items() if n in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]]
               for n in sig if n.endswith("_ptr") or n.startswith("stride")
               or n in ("N", "K", "K_SPLIT")}  # fmt: skip
    src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs=aligned)  # fmt: skip
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    return k.asm["ptx"]


def opcode_mix(ptx: str) -> dict[str, int]:
    """Instruction count per full opcode (e.g. "cvt.rn.bf16x2.f32") in a PTX text: predicated
    ones and those of inline-asm blocks (no indent) included, as are state-space qualified ones
    (e.g. "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes");
    directives, labels and braces are not opcodes."""
    ops = re.finditer(
        r"^\s*(?:@!?%\w+\s+)?([a-z]+(?:\.[a-z0-9_]+(?:::[a-z0-9_]+)*)*)(?=[\s;])", ptx, re.M
    )
    return dict(collections.Counter(m.group(1) for m in ops))


def _attention_sig(cache: str) -> dict[str, str]:
    """The unified attention kernel's typed arguments over a cache of element type `cache`."""
    from xlaserve.kernels_cuda import paged_attention as pa

    fn = pa._unified_attention_kernel
    sig = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
    sig.update(k_ptr=cache, v_ptr=cache, part_acc_ptr="*fp32", part_ml_ptr="*fp32",
               qsl_ptr="*i32", seq_lens_ptr="*i32", bt_ptr="*i32", ks_ptr="*fp32",
               vs_ptr="*fp32", sm_scale="fp32", soft_cap="fp32")  # fmt: skip
    for n in fn.arg_names:
        if n.startswith("stride_") or n in ("num_seqs", "num_tokens", "num_tiles", "window",
                                             "chunk"):  # fmt: skip
            sig[n] = "i32"
    return sig


def _attention_consts(**kw: Any) -> dict[str, Any]:  # noqa: ANN401
    """The 8B shape's constexprs (G 4, head 128, 16-token pages, no window / chunk / soft-cap),
    with `kw` on top."""
    base = dict(G=4, HEAD_DIM=128, BLOCK_D=128, PAGE=16, USE_WINDOW=False, USE_CHUNK=False,
                USE_SOFTCAP=False, UPCAST=False, DOT_PREC="tf32", QUANT=False, QUANT_F16=False,
                ZERO_PAD=False, USE_PDL=True, FAST_CAUSAL=True, OFFS64=False)  # fmt: skip
    return {**base, **kw}


def _attention() -> dict[str, dict[str, int]]:
    from xlaserve.kernels_cuda import paged_attention as pa

    fn = pa._unified_attention_kernel
    out = {}
    for label, cache, quant, f16 in (("bf16", "*bf16", False, False),
                                     ("fp8_bf16_dots", "*fp8e4nv", True, False),
                                     ("fp8_fp16_dots", "*fp8e4nv", True, True)):  # fmt: skip
        sig = _attention_sig(cache)
        for bn, stages in ((64, 3), (128, 4)):
            consts = _attention_consts(BLOCK_M=16, BLOCK_Q=4, BLOCK_N=bn, NUM_SPLITS=16,
                                       QUANT=quant, QUANT_F16=f16)  # fmt: skip
            out[f"{label} BLOCK_N={bn}"] = opcode_mix(_compile(fn, sig, consts, 4, stages))
    return out


def _attention_prefill() -> dict[str, dict[str, int]]:
    from xlaserve.kernels_cuda import paged_attention as pa

    out = {}
    for label, wide in (("table", False), ("wide", True)):
        cfg = pa.attention_launch_config(2, 4, 128, False, wide=wide)  # a prefill launch
        consts = _attention_consts(BLOCK_M=cfg["BLOCK_M"], BLOCK_Q=cfg["BLOCK_Q"],
                                   BLOCK_N=cfg["BLOCK_N"], NUM_SPLITS=1)  # fmt: skip
        ptx = _compile(pa._unified_attention_kernel, _attention_sig("*bf16"), consts,
                       cfg["num_warps"], cfg["num_stages"])  # fmt: skip
        tile = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"])
        out[f"bf16 prefill {label} {tile}"] = opcode_mix(ptx)
    return out


# `--kernels-from DIR`: the int8_mm / scaled_mm groups compile DIR/kernels_cuda's modules (another
# checkout, e.g. an earlier commit's worktree) instead of the installed ones: their mixes side by
# side with the tree's.
KERNELS_FROM: str | None = None


def _kernel_module(name: str) -> Any:  # noqa: ANN401
    """xlaserve.kernels_cuda.<name>, or that file of KERNELS_FROM loaded by path (its own
    imports resolve to the installed package)."""
    import importlib

    if KERNELS_FROM is None:
        return importlib.import_module(f"xlaserve.kernels_cuda.{name}")
    import importlib.util

    path = os.path.join(KERNELS_FROM, "kernels_cuda", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_ptx_mix_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _int8_mm() -> dict[str, dict[str, int]]:
    qm = _kernel_module("quant_matmul")

    sig = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32",
           "N": "i32", "K": "i32", "K_SPLIT": "i32", "stride_xm": "i32", "stride_wn": "i32",
           "stride_ys": "i32", "stride_ym": "i32"}  # fmt: skip
    t = qm.int8_dot_tiles(1 << 20)
    out = {}
    for swap in (False, True):
        consts = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                      GROUP_M=t.group_m, UPCAST=False, SWAP_AB=swap)  # fmt: skip
        ptx = _compile(qm._int8_mm_kernel, sig, consts, t.num_warps, t.num_stages)
        out[f"swap_ab={swap} {tuple(t[:6])}"] = opcode_mix(ptx)
    return out


def _scaled_mm() -> dict[str, dict[str, int]]:
    sm = _kernel_module("scaled_mm")

    out = {}
    for label, fmt, code, bits in (("int8", "int8", "*i8", False),
                                   ("fp8 typed", "fp8", "*fp8e4nv", False),
                                   ("fp8 uint8 bits", "fp8", "*u8", True)):  # fmt: skip
        t = sm.scaled_mm_tiles(fmt, 1 << 20)
        sig = {"a_ptr": code, "b_ptr": code, "as_ptr": "*fp32", "bs_ptr": "*fp32",
               "bias_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
               "K_SPLIT": "i32", "stride_am": "i32", "stride_bn": "i32", "stride_bsn": "i32",
               "stride_ys": "i32", "stride_ym": "i32"}  # fmt: skip
        consts = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                      INT_ACC=fmt == "int8", WB_N=0, WB_K=0, HAS_BIAS=False, FP8_BITS=bits,
                      UPCAST=False)  # fmt: skip
        ptx = _compile(sm._scaled_mm_kernel, sig, consts, t.num_warps, t.num_stages)
        out[f"{label} {tuple(t)}"] = opcode_mix(ptx)
    return out


def _ssm() -> dict[str, dict[str, int]]:
    from xlaserve.kernels_cuda import ssm

    out = {}
    fn = ssm._ssm_update_kernel
    sig = {n: "*fp32" for n in fn.arg_names if n.endswith("_ptr")}
    sig.update(slot_ptr="*i64", x_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16")
    for n in ("Hs", "P", "N", "G", "stride_hs", "stride_hh", "stride_hp", "stride_xb",
              "stride_xh", "stride_bb", "stride_bg"):  # fmt: skip
        sig[n] = "i32"
    for has_d in (False, True):
        ptx = _compile(fn, sig, dict(HAS_D=has_d, BLOCK_P=64, BLOCK_N=128))
        out[f"mamba HAS_D={has_d}"] = opcode_mix(ptx)
    fn = ssm._mamba2_update_kernel
    sig = {n: "*fp32" for n in fn.arg_names if n.endswith("_ptr")}
    sig.update(slot_ptr="*i64", xc_ptr="*bf16", dtr_ptr="*bf16", dt_lo="fp32", dt_hi="fp32")
    for n in ("Hs", "P", "N", "G", "DI", "stride_hs", "stride_hh", "stride_hp", "stride_xc",
              "stride_dt"):  # fmt: skip
        sig[n] = "i32"
    for has_d in (False, True):
        for clamp in (False, True):
            consts = dict(HAS_D=has_d, CLAMP=clamp, BLOCK_P=32, BLOCK_N=128)
            out[f"mamba2 HAS_D={has_d} CLAMP={clamp}"] = opcode_mix(_compile(fn, sig, consts))
    return out


def _act_quant() -> dict[str, dict[str, int]]:
    from xlaserve.kernels_cuda import fused_act_quant as faq

    out = {}
    sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "res_out_ptr": "*bf16",
           "q_ptr": "*i8", "s_ptr": "*fp32", "stride_x": "i32", "stride_r": "i32",
           "stride_ro": "i32", "stride_q": "i32", "hidden": "i32", "eps": "fp32",
           "weight_offset": "fp32"}  # fmt: skip
    for res in (False, True):
        consts = dict(HAS_RESIDUAL=res, BLOCK=1024, QMAX=127.0, INT8=True, RNE_FIX=False)
        ptx = _compile(faq._rms_norm_quant_kernel, sig, consts)
        out[f"rms_norm_quant HAS_RESIDUAL={res}"] = opcode_mix(ptx)
    sig = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "stride_x": "i32",
           "stride_q": "i32", "inter": "i32"}  # fmt: skip
    consts = dict(BLOCK=1024, QMAX=127.0, INT8=True, RNE_FIX=False)
    out["silu_mul_quant"] = opcode_mix(_compile(faq._silu_mul_quant_kernel, sig, consts))
    return out


def run(groups: list[str]) -> dict[str, dict[str, dict[str, int]]]:
    """group -> variant -> opcode -> count."""
    fns = {"attention": _attention, "attention_prefill": _attention_prefill,
           "int8_mm": _int8_mm, "scaled_mm": _scaled_mm, "ssm": _ssm,
           "act_quant": _act_quant}  # fmt: skip
    return {g: fns[g]() for g in groups}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", nargs="*", default=list(GROUPS), choices=GROUPS)
    ap.add_argument("--ops", nargs="*", default=None, help="print only these opcodes")
    ap.add_argument("--out", default=None, help="the whole mix as JSON")
    ap.add_argument("--kernels-from", default=None,
                    help="int8_mm / scaled_mm: DIR/kernels_cuda's modules (a checkout)")  # fmt: skip
    args = ap.parse_args(argv)
    global KERNELS_FROM
    KERNELS_FROM = args.kernels_from
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the kernels must compile for sm_90, not interpret")
    res = run(args.groups)
    for group, variants in res.items():
        for name, mix in variants.items():
            shown = {o: mix.get(o, 0) for o in args.ops} if args.ops else mix
            total = sum(mix.values())
            print(f"{group} | {name} | {total} instructions | {json.dumps(shown, sort_keys=True)}",
                  flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
