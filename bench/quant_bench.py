"""Quantization benchmark (issue 24): every weight / KV quantization mode side by side with bf16
in one command, end to end and per GEMM.

Rows (``--rows``; each in its own subprocess so one failure or OOM leaves the others, the JSON
merged into ``--output-json`` after each row):
- ``bf16``, ``fp8`` (w8a8: per-token fp8 activations; batch-1 decode through the fp8 GEMV),
  ``int8`` (weight-only), ``int8_w8a8`` (per-token int8 activations), ``int4``, ``fp8_kv``
  (bf16 weights, ``kv_cache_dtype="fp8"``), ``fp8_fp8kv`` (both), ``fp8_unfused`` /
  ``int8_w8a8_unfused`` (w8a8 with KernelConfig.fuse_act_quant off: the A/B of the act quant
  fused into its producers; ``_fused`` forces it on): ``LLM(model, load_format="dummy",
  quantization=Q)`` on the Llama-3.1-8B shape (``--llama8b``, default; ``--tiny`` for a CPU
  smoke test, or ``--model DIR`` such as the demo model):
    offline: ``--num-prompts`` random prompts of ``--input-len`` tokens, ``--output-len`` output
      tokens each (EOS ignored): output tokens / wall time;
    batch 1: a ``--batch1-input``-token prompt, ``--batch1-output`` greedy tokens: decode rate =
      (out - 1) / (t(out tokens) - t(1 token)), median of ``--repeats``;
  each with its ratio to the bf16 row and the KV cache's block count.
- ``--gemm``: a GEMM microbenchmark per M bucket (``--gemm-m``, default 1 8 64 256 1024 4096
  16384) on the Llama-8B linear shapes (K x N: 4096x6144 qkv, 4096x28672 gate_up, 14336x4096
  down, 4096x4096 o): every kernel variant (KernelConfig switches and paths) against bf16
  cuBLAS (F.linear), microseconds (CUDA events, median of ``--gemm-reps``), TFLOP/s and the
  ratio to bf16. Variants: int8 weight-only fused tl.dot / GEMV (``int8``), int8 dequantize +
  cuBLAS (``int8_dequant_cublas``), int8 w8a8 with torch._int_mm (``int8_w8a8_int_mm``) or the
  Triton GEMM (``int8_w8a8_triton``), fp8 w8a8 with torch._scaled_mm (``fp8_scaled_mm``) or
  Triton (``fp8_triton``), block-wise 128x128 fp8 (``fp8_block``), the fp8 GEMV (M <= 8,
  ``fp8_gemv``), and the per-token activation quantization alone (``quant_rows_int8`` /
  ``_fp8``, torch-ops twin ``quant_rows_torch_fp8``). w8a8 variants include the activation
  quantization (what a layer pays).
- ``--quality``: the shipped demo model's perplexity on a fixed KJV passage (prompt logprobs of
  one request) per row, and its ratio to the unquantized row (the issue's bound: <= 1.02).

Run on the H200 (the lead; ~8 minutes):
    python -m xlaserve.bench.quant_bench --llama8b --gemm --quality --output-json quant.json
CPU smoke test (demo model, tiny counts, tiny GEMM shapes in the Triton interpreter):
    python -m xlaserve.bench.quant_bench --model demo --num-prompts 4 --input-len 8 \
        --output-len 8 --batch1-input 8 --batch1-output 8 --repeats 1 --gemm --tiny-gemm \
        --quality --in-process --output-json quant.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from xlaserve.bench.common import run_stage as run_bench_stage
from xlaserve.bench.timing import graph_time_us

ROWS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "fp8": {"quantization": "fp8"},
    "int8": {"quantization": "int8"},
    "int8_w8a8": {"quantization": "int8_w8a8"},
    "int4": {"quantization": "int4"},
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    # fp8 weights and fp8 KV together (what a throughput deployment runs): the weights' fp8
    # leaves the attention's KV traffic (~40% of a batch-256 decode step) to the cache's codes.
    "fp8_fp8kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    # A/B of KernelConfig.fuse_act_quant (on by default, in the rows above): the per-token
    # quantization of down_proj's, qkv_proj's and gate_up_proj's inputs by their producers
    # (SiLU-and-mul, the pre-norms) off / on.
    "fp8_unfused": {"quantization": "fp8", "fuse_act_quant": False},
    "int8_w8a8_unfused": {"quantization": "int8_w8a8", "fuse_act_quant": False},
    "fp8_fused": {"quantization": "fp8", "fuse_act_quant": True},
    "int8_w8a8_fused": {"quantization": "int8_w8a8", "fuse_act_quant": True},
    # A/B of KernelConfig.int8_dequant_min_m (0 = never, the rows above): int8 weight-only
    # steps of >= 2048 tokens (prefill) dequantize the weight and run cuBLAS.
    "int8_dq2048": {"quantization": "int8", "int8_dequant_min_m": 2048},
    # A/B of KernelConfig.int8_gemm: int8 weight-only above the GEMV through CUTLASS's Hopper
    # mixed-input GEMM (kernels_cuda/cutlass_w8a16.py; the Triton kernel where it cannot run).
    "int8_cutlass": {"quantization": "int8", "int8_gemm": "cutlass"},
}
DEFAULT_ROWS = "bf16,fp8,int8,int8_w8a8,fp8_kv"
# (K, N) of the Llama-3.1-8B linears: qkv, gate_up, down, o.
GEMM_SHAPES = ((4096, 6144), (4096, 28672), (14336, 4096), (4096, 4096))
TINY_GEMM_SHAPES = ((128, 192), (256, 128))
GEMM_M = (1, 8, 64, 256, 1024, 4096, 16384)
TINY_GEMM_M = (1, 8, 40)


# A fixed held-out KJV passage (Genesis 50:1-4; public domain) for the perplexity row.
QUALITY_TEXT = (
    "And Joseph fell upon his father's face, and wept upon him, and kissed him.\n"
    "And Joseph commanded his servants the physicians to embalm his father: and the physicians "
    "embalmed Israel.\n"
    "And forty days were fulfilled for him; for so are fulfilled the days of those which are "
    "embalmed: and the Egyptians mourned for him threescore and ten days.\n"
    "And when the days of his mourning were past, Joseph spake unto the house of Pharaoh, saying, "
    "If now I have found grace in your eyes, speak, I pray you, in the ears of Pharaoh, saying,\n"
)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(2, vocab, size=(n, length)).tolist()


# ---- one end-to-end row ----------------------------------------------------------------------


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) with row `name`'s settings: offline and batch-1 rates, the KV block count."""
    import torch

    from xlaserve import LLM, SamplingParams

    kw: dict[str, Any] = dict(ROWS[name])
    res: dict[str, Any] = {"settings": kw}
    emulate = not torch.cuda.is_available() and kw.get("quantization") == "fp8"
    if emulate:  # CPU smoke test: emulated fp8 (an engine argument: nothing leaks to the process)
        res["fp8_emulated"] = True
    llm_kw: dict[str, Any] = dict(
        model=args.model_dir,
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        **kw,
    )
    if emulate:
        llm_kw["fp8_emulation"] = True
    if args.dummy:
        llm_kw["load_format"] = "dummy"
    if torch.cuda.is_available():
        llm_kw["gpu_memory_utilization"] = 0.9
    else:
        llm_kw["num_kv_blocks"] = args.cpu_kv_blocks
    t = time.perf_counter()
    llm = LLM(**llm_kw)
    res["load_s"] = time.perf_counter() - t
    res["num_kv_blocks"] = llm.llm_engine.kv_manager.num_blocks
    vocab = args.vocab
    # offline
    sp = SamplingParams(
        max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0, ignore_eos=True
    )
    warm = [{"prompt_token_ids": p} for p in _prompts(min(8, args.num_prompts), 16, vocab, 7)]
    llm.generate(warm, sp, use_tqdm=False)
    walls = []
    for r in range(args.offline_repeats):
        prompts = [{"prompt_token_ids": p}
                   for p in _prompts(args.num_prompts, args.input_len, vocab, 100 + r)]  # fmt: skip
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        walls.append(time.perf_counter() - t)
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        assert got == args.num_prompts * args.output_len, got
    wall = _median(walls)
    res["offline"] = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "wall_s": walls,
        "output_tokens_per_s": args.num_prompts * args.output_len / wall,
    }
    # batch 1
    p = {"prompt_token_ids": _prompts(1, args.batch1_input, vocab, 2)[0]}
    n_out = args.batch1_output
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=n_out, min_tokens=n_out, temperature=0.0, ignore_eos=True)
    llm.generate([p], full, use_tqdm=False)
    t1s, tns = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        llm.generate([p], one, use_tqdm=False)
        t1s.append(time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate([p], full, use_tqdm=False)
        tns.append(time.perf_counter() - t)
    dt = _median(tns) - _median(t1s)
    # On a loaded host with a few tokens the difference can vanish into the noise: the
    # end-to-end rate then, marked as such (never a NaN row).
    decode = dt > 0
    res["batch1"] = {
        "prompt_len": args.batch1_input,
        "output_len": n_out,
        "t_1_token_s": t1s,
        "t_all_tokens_s": tns,
        "decode_tokens_per_s": (n_out - 1) / dt if decode else n_out / _median(tns),
        "rate": "decode (prefill excluded)" if decode else "end to end (timing noise)",
    }
    llm.llm_engine.shutdown()
    return res


def run_quality(rows: list[str]) -> dict[str, Any]:
    """Demo-model perplexity of QUALITY_TEXT per row (exp of the mean negative prompt logprob)
    and its ratio to the "bf16" row (the model's own dtype on the CPU)."""
    import math

    import torch

    from xlaserve import LLM, SamplingParams
    from xlaserve.demo import demo_model_path

    cuda = torch.cuda.is_available()
    res: dict[str, Any] = {}
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for name in rows:
        kw = dict(ROWS[name], model=demo_model_path(), enable_prefix_caching=False)
        if not cuda and kw.get("quantization") == "fp8":
            kw["fp8_emulation"] = True  # the CPU has no fp8 matmul
        kw.update({"dtype": "bfloat16"} if cuda else {"num_kv_blocks": 64})
        try:
            llm = LLM(**kw)
            out = llm.generate([QUALITY_TEXT], sp, use_tqdm=False)[0]
            ids = out.prompt_token_ids
            pairs = zip(out.prompt_logprobs[1:], ids[1:], strict=True)
            lps = [pos[t].logprob for pos, t in pairs]
            res[name] = {"perplexity": math.exp(-sum(lps) / len(lps)), "tokens": len(ids)}
            llm.llm_engine.shutdown()
        except Exception as e:  # noqa: BLE001 - recorded, the other rows go on
            res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    base = res.get("bf16", {}).get("perplexity")
    for v in res.values():
        if base and "perplexity" in v:
            v["ratio_vs_bf16"] = v["perplexity"] / base
            v["within_2_percent"] = v["ratio_vs_bf16"] <= 1.02
    return res


# ---- GEMM microbenchmark ---------------------------------------------------------------------


GRAPH_CALLS = 10  # back-to-back calls per timed CUDA-graph replay


def _timer(fn: Any, reps: int) -> float:
    """Median microseconds of one fn() call: GRAPH_CALLS calls captured into one CUDA graph (as
    the engine's decode steps run: no host launch gaps, which a single call between two events
    measures instead of the kernels; `bench.timing`); wall time of one call on the CPU."""
    import torch

    return graph_time_us([fn] * (GRAPH_CALLS if torch.cuda.is_available() else 1), reps)


def gemm_variants(x: Any, k: int, n: int, dev: str) -> dict[str, Any]:
    """name -> a zero-argument callable computing x [M, K] times an [N, K] weight that way.
    Variants the device cannot run are left out."""
    import torch
    import torch.nn.functional as F

    from xlaserve.backends_torch.layers.linear import fp8_supported, quantize_fp8_block_torch
    from xlaserve.config import KernelConfig
    from xlaserve.kernels_cuda import quant_matmul as qm
    from xlaserve.kernels_cuda import scaled_mm as sm

    m = x.shape[0]
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dev)
    wb = w.to(x.dtype)
    s8 = w.abs().amax(1) / 127
    q8 = torch.round(w / s8[:, None]).to(torch.int8)
    out: dict[str, Any] = {"bf16": lambda: F.linear(x, wb)}
    out["int8"] = lambda: qm.int8_matmul(x, q8, s8)
    out["int8_dequant_cublas"] = lambda: F.linear(x, q8.to(x.dtype)) * s8.to(x.dtype)
    cfg_mm = KernelConfig(int8_w8a8_gemm="int_mm")
    cfg_tr = KernelConfig(int8_w8a8_gemm="triton")
    if dev == "cuda" and sm.int_mm_ok(m, n, k):
        out["int8_w8a8_int_mm"] = lambda: sm.int8_w8a8_matmul(x, q8, s8, kernels=cfg_mm)
    out["int8_w8a8_triton"] = lambda: sm.int8_w8a8_matmul(x, q8, s8, kernels=cfg_tr)
    out["quant_rows_int8"] = lambda: sm.quant_rows(x, "int8")
    fp8_ok = fp8_supported(dev) or dev == "cpu"  # the CPU: the interpreter
    if fp8_ok:
        s_f = w.abs().amax(1) / 448
        q_f = (w / s_f[:, None]).to(torch.float8_e4m3fn)
        cfg_sc = KernelConfig(fp8_gemm="scaled_mm")
        cfg_ft = KernelConfig(fp8_gemm="triton")
        if dev == "cuda":
            out["fp8_scaled_mm"] = lambda: sm.fp8_w8a8_matmul(x, q_f, s_f, kernels=cfg_sc)
        out["fp8_triton"] = lambda: sm.fp8_w8a8_matmul(x, q_f, s_f, kernels=cfg_ft)
        blk = quantize_fp8_block_torch(w, (128, 128))
        out["fp8_block"] = lambda: sm.fp8_w8a8_matmul(
            x, blk["qweight"], blk["scales"], block=(128, 128)
        )
        if m <= qm.GEMV_MAX_M and qm.fp8_gemv_supported(x.device):
            qb = q_f.view(torch.uint8)
            tiles = qm.gemv_tiles("fp8", m, n, k)
            out["fp8_gemv"] = lambda: qm.fp8_weight_matmul(x, qb, s_f, tiles=tiles)
        out["quant_rows_fp8"] = lambda: sm.quant_rows(x, "fp8")
        out["quant_rows_torch_fp8"] = lambda: sm.quant_rows_ref(x, "fp8")
    return out


def run_gemm(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = TINY_GEMM_SHAPES if args.tiny_gemm else GEMM_SHAPES
    ms = args.gemm_m or (TINY_GEMM_M if args.tiny_gemm else GEMM_M)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    for k, n in shapes:
        key = f"{k}x{n}"
        res[key] = {}
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            row: dict[str, Any] = {}
            for name, fn in gemm_variants(x, k, n, dev).items():
                try:
                    us = _timer(fn, args.gemm_reps)
                    row[name] = {"us": us, "tflops": 2 * m * n * k / us / 1e6}
                except Exception as e:  # noqa: BLE001 - a variant failing is a result too
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            base = row.get("bf16", {}).get("us")
            for v in row.values():
                if base and "us" in v:
                    v["speedup_vs_bf16"] = base / v["us"]
            res[key][str(m)] = row
            print(f"gemm {key} M={m}: " + ", ".join(
                f"{nm} {v['us']:.1f}us" for nm, v in row.items() if "us" in v), flush=True)  # fmt: skip
    return res


# ---- driver ----------------------------------------------------------------------------------


def _model_dir(args: argparse.Namespace) -> str:
    if args.model in (None, "llama8b") or args.llama8b or args.tiny:
        from xlaserve.bench.gpu_bench import LLAMA_8B, TINY, write_model_dir

        work = args.work_dir or tempfile.mkdtemp(prefix="quant-bench-")
        args.dummy = True
        args.vocab = TINY["vocab_size"] if args.tiny else LLAMA_8B["vocab_size"]
        return write_model_dir(os.path.join(work, "llama8b"), args.num_layers, args.tiny)
    if args.model == "demo":
        from xlaserve.demo import demo_model_path

        path = demo_model_path()
    else:
        path = args.model
    with open(os.path.join(path, "config.json")) as f:
        args.vocab = int(json.load(f)["vocab_size"])
    return path


def _stage_cmd(args: argparse.Namespace, stage: str, out: str) -> list[str]:
    cmd = [sys.executable, "-m", "xlaserve.bench.quant_bench", "--stage", stage]
    cmd += ["--stage-out", out, "--model-dir", args.model_dir, "--vocab", str(args.vocab)]
    cmd += ["--dummy"] if args.dummy else []
    cmd += ["--tiny-gemm"] if args.tiny_gemm else []
    cmd += ["--enforce-eager"] if args.enforce_eager else []
    for k in ("num_prompts", "input_len", "output_len", "batch1_input", "batch1_output",
              "repeats", "offline_repeats", "max_num_seqs", "max_num_batched_tokens",
              "cpu_kv_blocks", "gemm_reps"):  # fmt: skip
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.gemm_m:
        cmd += ["--gemm-m", *map(str, args.gemm_m)]
    return cmd


def _stage(args: argparse.Namespace, stage: str) -> dict[str, Any]:
    """Run one row (or the GEMM sweep): in this process, or in a subprocess (default)."""
    out = os.path.join(args.work_dir or tempfile.gettempdir(), f"quant-{stage}.json")
    inner = (
        (lambda: run_gemm(args) if stage == "gemm" else run_row(stage, args))
        if args.in_process
        else None
    )
    return run_bench_stage(inner, _stage_cmd(args, stage, out), out, args.stage_timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-json", default="quant_bench.json")
    ap.add_argument("--model", default=None, help="'demo', a model dir, or the 8B shape (default)")
    ap.add_argument("--llama8b", action="store_true", help="Llama-3.1-8B shape, dummy weights")
    ap.add_argument("--tiny", action="store_true", help="the 8B config shrunk (CPU smoke test)")
    ap.add_argument("--num-layers", type=int, default=32)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma list of {sorted(ROWS)}")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch1-input", type=int, default=128)
    ap.add_argument("--batch1-output", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--offline-repeats", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--cpu-kv-blocks", type=int, default=256, help="KV blocks without a GPU")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--gemm", action="store_true", help="also the GEMM microbenchmark")
    ap.add_argument("--quality", action="store_true", help="also the demo-model perplexities")
    ap.add_argument("--gemm-only", action="store_true")
    ap.add_argument("--gemm-m", type=int, nargs="*", default=None)
    ap.add_argument("--gemm-reps", type=int, default=20)
    ap.add_argument("--tiny-gemm", action="store_true", help="small GEMM shapes (CPU)")
    ap.add_argument("--in-process", action="store_true", help="no subprocess per row (tests)")
    ap.add_argument("--stage-timeout", type=int, default=300)
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stage-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if not os.path.exists("/proc/driver/nvidia/version"):  # CPU: Triton kernels interpreted
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.stage:  # a subprocess of the driver
        res = run_gemm(args) if args.stage == "gemm" else run_row(args.stage, args)
        with open(args.stage_out, "w") as f:
            json.dump(res, f, indent=1)
        return 0

    rows = [] if args.gemm_only else [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        ap.error(f"unknown rows {bad}; choose from {sorted(ROWS)}")
    args.model_dir = _model_dir(args)
    result: dict[str, Any] = {"model": args.model or "llama8b", "rows": {}, "args": vars(args)}

    def save() -> None:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1, default=str)

    for name in rows:
        print(f"== row {name}", flush=True)
        result["rows"][name] = _stage(args, name)
        save()
    base = result["rows"].get("bf16", {})
    for row in result["rows"].values():
        for part, key in (("offline", "output_tokens_per_s"), ("batch1", "decode_tokens_per_s")):
            b = base.get(part, {}).get(key)
            v = row.get(part, {}).get(key)
            if b and v:
                row[part]["ratio_vs_bf16"] = v / b
        if base.get("num_kv_blocks") and row.get("num_kv_blocks"):
            row["kv_blocks_ratio_vs_bf16"] = row["num_kv_blocks"] / base["num_kv_blocks"]
    if args.quality:
        print("== quality", flush=True)
        result["quality"] = run_quality(["bf16"] + [r for r in ROWS if r != "bf16"])
        save()
    if args.gemm or args.gemm_only:
        print("== gemm", flush=True)
        result["gemm"] = _stage(args, "gemm")
    save()
    for name, row in result["rows"].items():
        off, b1 = row.get("offline", {}), row.get("batch1", {})
        print(f"{name:10s} offline {off.get('output_tokens_per_s', float('nan')):10.1f} tok/s "
              f"({off.get('ratio_vs_bf16', float('nan')):.2f}x)  batch1 "
              f"{b1.get('decode_tokens_per_s', float('nan')):8.1f} tok/s "
              f"({b1.get('ratio_vs_bf16', float('nan')):.2f}x)  {row.get('error', '')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
