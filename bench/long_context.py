"""Long-context and fp8-KV benchmark (issue 24): every row side by side in one command.

Stages (``--stages``; each in its own subprocess so one failure, OOM or timeout leaves the others
and GPU memory is returned between them; the JSON is merged into ``--output-json`` after each):
- ``bf16``: ``LLM(model, load_format="dummy")`` on the Llama-3.1-8B shape, max_model_len 32768
  (``--max-model-len``), torch backend, default limits otherwise (prefix caching on):
    TTFT of one ``--prefill-len`` (30,000) random-token prompt, max_tokens=1: median of
      ``--repeats`` fresh prompts (nothing cached) after one warm-up prompt;
    decode at that context: the last prompt again (now prefix-cached, so both timings pay the
      same short prefill): rate = (N - 1) / (t(N tokens) - t(1 token)), N = ``--decode-output``
      (256), medians of ``--repeats``;
    offline: ``--offline-prompts`` x ``--offline-input`` / ``--offline-output`` (256 x 1024 /
      128) random prompts, output tokens / wall time; and the KV cache's block count.
- ``fp8kv``: the same with ``kv_cache_dtype="fp8"``.
- ``hf``: transformers' ``LlamaForCausalLM`` of the same config (random bf16 weights,
  ``attn_implementation="sdpa"``), ``torch.no_grad`` forward of the same 30,000-token prompt
  (``use_cache=False``, ``logits_to_keep=1``: the last position's logits, as the engine computes),
  CUDA-synchronized wall time, median of ``--repeats`` after a warm-up.
- ``ctx128k``: max_model_len 131072 (``--long-max-model-len``), one ``--long-len`` (128,000)
  token prompt: TTFT (after a short warm-up prompt) and the decode rate as above
  (``--long-repeats``, default 1), and the KV block count.
- ``nosdpa``: the ``bf16`` stage with ``prefill_sdpa="off"`` (every prefill chunk through the
  Triton kernel; the default on CUDA sends chunks of >= 4096 queries through cuDNN over their
  gathered context): its TTFT, decode and offline rows beside the default's (the A/B of that
  switch; ``rows.prefill30k.prefill_sdpa_off``).
- ``splits32``: the ``bf16`` engine with ``graph_max_kv_splits=32`` (the batch-1 decode graph's
  split-KV factor; the default cap is 16), max_num_seqs 8: the decode rate at the 30k context
  only (the A/B of that default).
- ``kernels``: the attention kernel alone (kernels_cuda.unified_attention, one layer's shape:
  32 q / 8 kv heads, head_dim 128, page 16): causal prefill of the whole ``--prefill-len`` prompt in
  one launch against torch SDPA (``is_causal``; K/V repeated to the q heads beforehand) on the
  same tensors, TFLOP/s, with and without the kernel's causal fast path
  (``paged_attention.CAUSAL_FAST_PATH``: the A/B of that change) and the ``prefill_sdpa`` path on
  the paged cache (gather + SDPA, its largest difference from Triton's output); decode of one token at 30k and 128k contexts for each split-KV factor
  (1..64; the batch-1 decode graph uses 16) bf16 and fp8, microseconds and GB/s of KV read.

Rows (``rows`` in the JSON; each with its goal from the issue):
- ``prefill30k``: xlaserve TTFT / SDPA forward time (goal <= 0.9);
- ``decode30k``: decode tok/s and its memory roofline: (weight bytes read per step + KV bytes at
  the mean decode context) / bandwidth, at ``--bandwidth-gbs`` (the GPU's spec, HBM_GBS) and
  ``--alt-bandwidth-gbs`` (4300, the issue's figure); fraction of roofline (goal >= 0.85). Weight
  bytes: every parameter but the input embedding (one row of it is read per token);
  ``weight_bytes_all`` (with it, the issue's 16.1 GB) is there too; ``issue_definition``: the
  issue's own roofline, all 16.1 GB + KV at the card's copy rate measured in the bf16 stage
  (``copy_gbs``, bytes read and written; the issue's 4.3 TB/s is the H200's);
- ``ctx128k``: TTFT and decode tok/s (reported, with the roofline fraction);
- ``fp8kv``: offline output tok/s fp8 / bf16 (goal >= 1.0), KV blocks fp8 / bf16 (goal >= 1.9),
  decode tok/s at 30k fp8 / bf16.

Run on the H200 (the lead; ~4-5 minutes of device time):
    python -m xlaserve.bench.long_context --llama8b --output-json long.json
CPU smoke test (the 8B config shrunk, 2 layers, contexts of a few hundred tokens, the Triton
kernels interpreted; a few seconds):
    python -m xlaserve.bench.long_context --tiny --in-process --output-json long.json
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

STAGES = ("bf16", "hf", "fp8kv", "ctx128k", "kernels", "splits32", "nosdpa")
ENGINE_STAGES: dict[str, dict[str, Any]] = {
    "bf16": {},
    # Every prefill chunk through the Triton kernel (KernelConfig.prefill_sdpa off; the default
    # on CUDA sends long chunks through cuDNN): the bf16 stage's rows, the A/B of that switch.
    "nosdpa": {"prefill_sdpa": "off"},
    "fp8kv": {"kv_cache_dtype": "fp8"},
    "ctx128k": {},
    # The batch-1 decode graph with 32 KV splits (default cap 16: 8 kv heads x 16 = 128
    # programs, one per SM of the H200) at the 30k context: decode rate only.
    "splits32": {"graph_max_kv_splits": 32},
}
# Split-KV factors the kernel stage sweeps (the kernel takes powers of 2 up to 64).
KV_SPLITS = (1, 2, 4, 8, 16, 32, 64)

# Per-mode defaults of the sizes (None on the command line = this table).
SIZES: dict[str, dict[str, int]] = {
    "llama8b": {
        "num_layers": 32,
        "prefill_len": 30000,
        "max_model_len": 32768,
        "decode_output": 256,
        "long_len": 128000,
        "long_max_model_len": 131072,
        "offline_prompts": 256,
        "offline_input": 1024,
        "offline_output": 128,
        "max_num_seqs": 256,
        "long_max_num_seqs": 8,
        "kernel_prefill_len": 30000,
    },
    "tiny": {
        "num_layers": 2,
        "prefill_len": 96,
        "max_model_len": 128,
        "decode_output": 16,
        "long_len": 160,
        "long_max_model_len": 192,
        "offline_prompts": 4,
        "offline_input": 32,
        "offline_output": 6,
        "max_num_seqs": 8,
        "long_max_num_seqs": 2,
        "kernel_prefill_len": 48,
    },
}


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(2, vocab, size=(n, length)).tolist()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config.json the stages share (Llama-3.1-8B, or shrunk with --tiny)."""
    from xlaserve.bench.gpu_bench import LLAMA_8B, TINY

    cfg = dict(LLAMA_8B, num_hidden_layers=args.num_layers)
    if args.tiny:
        cfg.update(TINY)
    # Llama 3.1's own value: the 128k row runs inside the positions the model declares (the
    # rope cos/sin table of the torch backend covers max(this, original * factor)).
    cfg["max_position_embeddings"] = max(args.long_max_model_len, args.max_model_len)
    if args.tiny:  # llama3 rope wants the original length below max_position_embeddings
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], original_max_position_embeddings=64)
    return cfg


def write_model(args: argparse.Namespace) -> str:
    """gpu_bench.write_model_dir's directory (config + tokenizer), config from model_config."""
    from xlaserve.bench.gpu_bench import write_model_dir

    path = write_model_dir(os.path.join(args.work_dir, "model"), args.num_layers, args.tiny)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model_config(args), f, indent=1)
    return path


# ---- the memory roofline ----------------------------------------------------------------------


def weight_bytes(cfg: dict[str, Any], dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes of the weights a decode step reads (every parameter but the input embedding, of
    which one row per token is read) and of all parameters (the issue's 16.1 GB)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hq, hkv, d, vocab = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                         cfg["head_dim"], cfg["vocab_size"])  # fmt: skip
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inter + 2 * h
    read = layers * per_layer + h + (0 if cfg.get("tie_word_embeddings") else vocab * h)
    return {"read": read * dtype_bytes, "all": (read + vocab * h) * dtype_bytes}


def kv_bytes(cfg: dict[str, Any], context: float, kv_dtype: str = "bf16") -> float:
    """KV bytes one decode step reads at `context` tokens: K and V of every layer and kv head;
    fp8 / int8: one byte per element plus a float32 scale per (token, kv head) for K and V."""
    per_head = cfg["head_dim"] * 2 if kv_dtype == "bf16" else cfg["head_dim"] + 4
    return context * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * per_head


def roofline(
    cfg: dict[str, Any], context: float, rate: float | None, bandwidths: list[float],
    kv_dtype: str = "bf16",
) -> dict[str, Any]:  # fmt: skip
    """Memory-bound decode ceiling at `context` for each bandwidth (GB/s) and `rate`'s fraction."""
    wb = weight_bytes(cfg)
    kvb = kv_bytes(cfg, context, kv_dtype)
    out: dict[str, Any] = {
        "context": context,
        "weight_bytes": wb["read"],
        "weight_bytes_all": wb["all"],
        "kv_bytes": kvb,
        "kv_dtype": kv_dtype,
    }
    for bw in bandwidths:
        ceiling = bw * 1e9 / (wb["read"] + kvb)
        ent: dict[str, Any] = {"roofline_tokens_per_s": ceiling}
        ent["roofline_tokens_per_s_all_weights"] = bw * 1e9 / (wb["all"] + kvb)
        if rate:
            ent["fraction"] = rate / ceiling
            ent["fraction_all_weights"] = rate / ent["roofline_tokens_per_s_all_weights"]
        out[f"{int(bw)}_gbs"] = ent
    return out


# ---- engine stages ----------------------------------------------------------------------------


def _llm(args: argparse.Namespace, stage: str) -> Any:
    import torch

    from xlaserve import LLM

    long = stage == "ctx128k"
    few = long or stage == "splits32"  # one request at a time: fewer decode graphs to capture
    kw: dict[str, Any] = dict(
        model=args.model_dir,
        load_format="dummy",
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        max_model_len=args.long_max_model_len if long else args.max_model_len,
        max_num_seqs=args.long_max_num_seqs if few else args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        **ENGINE_STAGES[stage],
    )
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        kw["cpu_kv_cache_bytes"] = args.cpu_kv_cache_bytes
    return LLM(**kw)


def _long_prompt(
    llm: Any, prompt: list[int], n_out: int, repeats: int, fresh: list[list[int]]
) -> dict[str, Any]:
    """TTFT of each `fresh` prompt (nothing cached), then the decode rate on `prompt` (cached
    after its first run): (n_out - 1) / (median t(n_out) - median t(1)). Where that difference
    is not positive (timing noise larger than the decode: tiny models on a loaded host), the
    rate comes from the engine's own first / last token timestamps of the n_out runs instead,
    and `method` says so."""
    from xlaserve import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=n_out, min_tokens=n_out, temperature=0.0, ignore_eos=True)
    engine_rates: list[float] = []

    def timed(p: list[int], sp: Any) -> float:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t
        assert len(out.outputs[0].token_ids) == sp.max_tokens, len(out.outputs[0].token_ids)
        m = out.metrics
        if sp.max_tokens > 1 and m is not None and m.last_token_time and m.first_token_time:
            span = m.last_token_time - m.first_token_time
            if span > 0:
                engine_rates.append((sp.max_tokens - 1) / span)
        return dt

    ttft = [timed(p, one) for p in fresh]
    timed(prompt, full)  # fills the prefix cache with the prompt (and warms the n_out path)
    engine_rates.clear()
    t1s, tns = [], []
    for _ in range(repeats):
        t1s.append(timed(prompt, one))
        tns.append(timed(prompt, full))
    dt = _median(tns) - _median(t1s)
    engine_rate = _median(engine_rates) if engine_rates else float("nan")
    return {
        "prompt_len": len(prompt),
        "ttft_s": ttft,
        "ttft_median_s": _median(ttft),
        "decode": {
            "output_len": n_out,
            "t_1_token_s": t1s,
            "t_all_tokens_s": tns,
            "decode_tokens_per_s": (n_out - 1) / dt if dt > 0 else engine_rate,
            "method": "difference" if dt > 0 else "engine_timestamps",
            "engine_timed_tokens_per_s": engine_rate,
        },
    }


def copy_gbs(nbytes: int = 1 << 30, reps: int = 10) -> float | None:
    """The GPU's copy rate in GB/s, counting bytes read and written (the issue's 4.3 TB/s for
    the H200 is this figure): the median of `reps` device-to-device copies of nbytes, timed with
    CUDA events; None without CUDA. Run before the engine takes the memory."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9


def run_engine_stage(stage: str, args: argparse.Namespace) -> dict[str, Any]:
    """One LLM: the long prompt's TTFT and decode rate, the offline run (not in ctx128k), the KV
    block count; partial results are written after each part. The bf16 stage first measures
    the GPU's copy rate (`copy_gbs`: the bandwidth of the issue's roofline)."""
    from xlaserve import SamplingParams

    res: dict[str, Any] = {"settings": ENGINE_STAGES[stage]}
    if stage == "bf16":
        res["copy_gbs"] = copy_gbs()
    t = time.perf_counter()
    llm = _llm(args, stage)
    res["load_s"] = time.perf_counter() - t
    res["num_kv_blocks"] = llm.llm_engine.kv_manager.num_blocks
    res["block_size"] = llm.llm_engine.kv_manager.block_size
    res["max_model_len"] = args.long_max_model_len if stage == "ctx128k" else args.max_model_len
    _save_partial(args, res)
    vocab = args.vocab
    warm = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0, ignore_eos=True)
    if stage == "ctx128k":
        n = args.long_len
        short = _prompts(1, min(1024, n // 2), vocab, 5)[0]
        llm.generate([{"prompt_token_ids": short}], warm, use_tqdm=False)
        fresh = _prompts(args.long_repeats, n, vocab, 300)
        res["long"] = _long_prompt(llm, fresh[-1], args.decode_output, args.long_repeats, fresh)
    elif stage == "splits32":
        n = args.prefill_len
        llm.generate([{"prompt_token_ids": _prompts(1, 64, vocab, 5)[0]}], warm, use_tqdm=False)
        fresh = _prompts(1, n, vocab, 200)
        res["long"] = _long_prompt(llm, fresh[-1], args.decode_output, args.repeats, fresh)
    else:
        n = args.prefill_len
        # Warm-up: one long prompt (compiles every prefill / decode shape on the way).
        llm.generate([{"prompt_token_ids": _prompts(1, n, vocab, 5)[0]}], warm, use_tqdm=False)
        fresh = _prompts(args.repeats, n, vocab, 200)
        res["long"] = _long_prompt(llm, fresh[-1], args.decode_output, args.repeats, fresh)
        _save_partial(args, res)
        sp = SamplingParams(max_tokens=args.offline_output, min_tokens=args.offline_output,
                            temperature=0.0, ignore_eos=True)  # fmt: skip
        prompts = [{"prompt_token_ids": p} for p in
                   _prompts(args.offline_prompts, args.offline_input, vocab, 100)]  # fmt: skip
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        assert got == args.offline_prompts * args.offline_output, got
        res["offline"] = {
            "num_prompts": args.offline_prompts,
            "input_len": args.offline_input,
            "output_len": args.offline_output,
            "wall_s": wall,
            "output_tokens_per_s": got / wall,
        }
    llm.llm_engine.shutdown()
    return res


# ---- transformers' SDPA forward -----------------------------------------------------------------


def run_hf(args: argparse.Namespace) -> dict[str, Any]:
    """transformers forward of the --prefill-len prompt, sdpa attention, random bf16 weights."""
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    fields = {k: v for k, v in model_config(args).items() if k != "architectures"}
    cfg = transformers.LlamaConfig(**fields, attn_implementation="sdpa")
    dtype = torch.bfloat16 if cuda else torch.float32
    t = time.perf_counter()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    _sync()
    res: dict[str, Any] = {
        "transformers": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
        "build_s": time.perf_counter() - t,
        "prompt_len": args.prefill_len,
        "logits_to_keep": 1,
    }

    def forward(p: list[int]) -> float:
        ids = torch.tensor([p], device=dev)
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
        _sync()
        assert out.logits.shape[1] == 1, out.logits.shape
        return time.perf_counter() - t0

    forward(_prompts(1, args.prefill_len, args.vocab, 5)[0])  # warm-up
    times = [forward(p) for p in _prompts(args.repeats, args.prefill_len, args.vocab, 200)]
    res["forward_s"] = times
    res["forward_median_s"] = _median(times)
    return res


# ---- the attention kernel alone ------------------------------------------------------------------


def _timer_us(fn: Any, reps: int) -> float:
    """Median microseconds of fn(), replayed from a CUDA graph (`bench.timing`: one eager call
    between two events times the host's launch of a microsecond decode kernel, not the kernel);
    wall time on the CPU."""
    return graph_time_us([fn], reps)


def _prefill_case(n: int, q_len: int, shape: tuple[int, int, int], g: Any) -> tuple[Any, ...]:
    """One sequence's prefill chunk: its last q_len queries over an n-token paged context.
    (q [q_len, Hq, D], k / v caches, block table [1, N], query_start_loc, seq_lens)."""
    import torch

    hq, _, d = shape
    k, v, bt = _paged_cache(n, shape, g)
    dev, dtype = k.device, k.dtype
    q = torch.randn(q_len, hq, d, generator=g).to(dev, dtype)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
    sl = torch.tensor([n], dtype=torch.int32, device=dev)
    return q, k, v, bt, qsl, sl


def _kernel_prefill(n: int, shape: tuple[int, int, int], reps: int, g: Any) -> dict[str, Any]:
    """Causal prefill of one n-token sequence, one launch of the paged kernel (shuffled block
    table, page 16) against torch SDPA on the same tensors (K/V repeated to the q heads before
    the timing), microseconds and TFLOP/s."""
    import torch
    import torch.nn.functional as F

    from xlaserve.kernels_cuda import paged_attention
    from xlaserve.kernels_cuda.paged_attention import unified_attention
    from xlaserve.kernels_cuda.prefill_sdpa import sdpa_prefill

    hq, hkv, d = shape
    q, k, v, bt, qsl, sl = _prefill_case(n, n, shape, g)
    scale = d**-0.5
    flops = 4 * hq * d * n * (n + 1) / 2  # QK^T and PV over the causal lower triangle
    res: dict[str, Any] = {"tokens": n, "causal_flops": flops}
    # "triton": the kernel as shipped; "triton_plain": without its causal fast path (tiles in
    # order, the mask on every key tile), the kernel before it: the A/B of that change.
    for label, fast in (("triton", True), ("triton_plain", False)):
        before = paged_attention.CAUSAL_FAST_PATH
        paged_attention.CAUSAL_FAST_PATH = fast
        try:
            us = _timer_us(lambda: unified_attention(q, k, v, None, qsl, sl, bt, n, n, scale), reps)
            res[f"{label}_us"] = us
            res[f"{label}_tflops"] = flops / us / 1e6
        except Exception as e:  # noqa: BLE001 - a failing variant is a result too
            res[f"{label}_error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            paged_attention.CAUSAL_FAST_PATH = before
    order = bt[0].long()
    kc = k[order].reshape(-1, hkv, d)[:n].repeat_interleave(hq // hkv, 1).transpose(0, 1)[None]
    vc = v[order].reshape(-1, hkv, d)[:n].repeat_interleave(hq // hkv, 1).transpose(0, 1)[None]
    qc = q.transpose(0, 1)[None]
    us = _timer_us(lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True), reps)
    res["sdpa_us"] = us
    res["sdpa_tflops"] = flops / us / 1e6
    # "paged_sdpa": the engine's prefill_sdpa path on the paged cache (the context gathered
    # through the block table, then SDPA with GQA), and its largest difference from Triton's.
    out = torch.empty_like(q)
    try:
        us = _timer_us(lambda: sdpa_prefill(q, k, v, bt, ((0, 0, n, n),), scale, out), reps)
        res["paged_sdpa_us"] = us
        res["paged_sdpa_tflops"] = flops / us / 1e6
        ref = unified_attention(q, k, v, None, qsl, sl, bt, n, n, scale)
        res["paged_sdpa_max_abs_diff_vs_triton"] = float((out.float() - ref.float()).abs().max())
    except Exception as e:  # noqa: BLE001 - a failing variant is a result too
        res["paged_sdpa_error"] = f"{type(e).__name__}: {e}"[:300]
    for label in ("triton", "triton_plain", "paged_sdpa"):
        if f"{label}_us" in res:
            res[f"{label}_vs_sdpa_time"] = res[f"{label}_us"] / res["sdpa_us"]
    return res


def _kernel_prefill_chunk(
    n: int, first: int, shape: tuple[int, int, int], reps: int, g: Any
) -> dict[str, Any]:
    """The engine's later prefill chunk of an n-token prompt whose first `first` tokens were
    an earlier chunk: n - first queries, the last positions of an n-token paged context
    (causal aligned to the last key). Triton's kernel against the `prefill_sdpa` path, whose
    SDPA call then takes `causal_lower_right` with GQA; `flash_eligible` is torch's own check
    of that call (False: an efficient-attention or math fallback)."""
    import torch

    from xlaserve.kernels_cuda.paged_attention import unified_attention
    from xlaserve.kernels_cuda.prefill_sdpa import sdpa_prefill

    hq, hkv, d = shape
    q_len = n - first
    q, k, v, bt, qsl, sl = _prefill_case(n, q_len, shape, g)
    scale = d**-0.5
    # Query i (0-based in the chunk) sees first + i + 1 keys.
    flops = 4 * hq * d * (q_len * first + q_len * (q_len + 1) / 2)
    res: dict[str, Any] = {"tokens": n, "first_chunk": first, "queries": q_len, "flops": flops}
    try:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        kb = k.reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
        qb = q.transpose(0, 1)[None]
        res["flash_eligible"] = bool(
            can_use_flash_attention(SDPAParams(qb, kb, kb, None, 0.0, False, True), True)
        )
    except Exception as e:  # noqa: BLE001 - the check's signature moves between torch versions
        res["flash_eligible_error"] = f"{type(e).__name__}: {e}"[:200]
    fns = {
        "triton": lambda: unified_attention(q, k, v, None, qsl, sl, bt, q_len, n, scale),
        "paged_sdpa": lambda: sdpa_prefill(q, k, v, bt, ((0, 0, q_len, n),), scale, out),
    }
    out = torch.empty_like(q)
    for label, fn in fns.items():
        try:
            us = _timer_us(fn, reps)
            res[f"{label}_us"], res[f"{label}_tflops"] = us, flops / us / 1e6
        except Exception as e:  # noqa: BLE001 - a failing variant is a result too
            res[f"{label}_error"] = f"{type(e).__name__}: {e}"[:300]
    if "paged_sdpa_us" in res and "triton_us" in res:
        sdpa_prefill(q, k, v, bt, ((0, 0, q_len, n),), scale, out)
        ref = fns["triton"]()
        res["paged_sdpa_max_abs_diff_vs_triton"] = float((out.float() - ref.float()).abs().max())
    return res


def _kernel_decode(
    ctx: int, shape: tuple[int, int, int], splits: list[int], reps: int, g: Any
) -> dict[str, Any]:
    """One decode token over a ctx-token paged cache, bf16 and fp8 (codes + float32 scales),
    for each split-KV factor: microseconds and GB/s of K/V (+ scales) read."""
    import torch

    from xlaserve.kernels_cuda.kv_quant import quantize_kv
    from xlaserve.kernels_cuda.paged_attention import unified_attention

    hq, hkv, d = shape
    k, v, bt = _paged_cache(ctx, shape, g)
    dev, dtype = k.device, k.dtype
    q = torch.randn(1, hq, d, generator=g).to(dev, dtype)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
    kq, ks = quantize_kv(k, torch.float8_e4m3fn)
    vq, vs = quantize_kv(v, torch.float8_e4m3fn)
    caches = {"bf16": (k, v, None, None), "fp8": (kq, vq, ks, vs)}
    one_layer = {"num_hidden_layers": 1, "num_key_value_heads": hkv, "head_dim": d}
    row: dict[str, Any] = {}
    for kv_dtype, (kc, vc, ksc, vsc) in caches.items():
        nbytes = kv_bytes(one_layer, ctx, kv_dtype)
        for s in splits:

            def fn(s: int = s, kc: Any = kc, vc: Any = vc, ksc: Any = ksc, vsc: Any = vsc) -> Any:
                return unified_attention(q, kc, vc, None, qsl, sl, bt, 1, ctx, d**-0.5,
                                         num_kv_splits=s, k_scale=ksc, v_scale=vsc)  # fmt: skip

            try:
                us = _timer_us(fn, reps)
                row[f"{kv_dtype}_splits{s}"] = {"us": us, "gbs": nbytes / us / 1e3}
            except Exception as e:  # noqa: BLE001 - a failing variant is a result too
                row[f"{kv_dtype}_splits{s}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return row


def _paged_cache(ctx: int, shape: tuple[int, int, int], g: Any) -> tuple[Any, Any, Any]:
    """Random K, V caches [N, 16, Hkv, D] covering ctx tokens and a shuffled block table
    [1, N] (a real cache's blocks are not in order); bf16 on CUDA, float32 on the CPU."""
    import torch

    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    _, hkv, d = shape
    nblk = -(-ctx // 16)
    k = torch.randn(nblk, 16, hkv, d, generator=g).to(dev, dtype)
    v = torch.randn(nblk, 16, hkv, d, generator=g).to(dev, dtype)
    bt = torch.randperm(nblk, generator=g).to(device=dev, dtype=torch.int32)[None, :]
    return k, v, bt


def run_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """The attention kernel alone at this model's head shape: prefill vs SDPA, and split-KV
    decode per split factor at each --kernel-contexts."""
    import torch

    cfg = model_config(args)
    cuda = torch.cuda.is_available()
    shape = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    g = torch.Generator(device="cpu").manual_seed(0)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                           "heads": list(shape), "page": 16}  # fmt: skip
    res["prefill"] = _kernel_prefill(args.kernel_prefill_len, shape, args.kernel_reps, g)
    print(f"kernels prefill {args.kernel_prefill_len}: {res['prefill']}", flush=True)
    # The engine's step budget splits the prompt (H200 offline: 16,384 tokens a step): the
    # later chunk attends over a cached prefix, a different SDPA call (issue 24's puzzle).
    first = args.kernel_prefill_len * 16384 // 30000
    res["prefill_chunk"] = _kernel_prefill_chunk(
        args.kernel_prefill_len, first, shape, args.kernel_reps, g
    )
    print(f"kernels prefill chunk: {res['prefill_chunk']}", flush=True)
    res["decode"] = {}
    for ctx in args.kernel_contexts:
        row = _kernel_decode(ctx, shape, args.kernel_splits, args.kernel_reps, g)
        res["decode"][str(ctx)] = row
        print(f"kernels decode ctx {ctx}: " + ", ".join(
            f"{nm} {r['us']:.1f}us" for nm, r in row.items() if "us" in r), flush=True)  # fmt: skip
    return res


# ---- driver -----------------------------------------------------------------------------------


def _save_partial(args: argparse.Namespace, res: dict[str, Any]) -> None:
    if args.stage_out:
        with open(args.stage_out, "w") as f:
            json.dump(res, f, indent=1)


def run_stage(stage: str, args: argparse.Namespace) -> dict[str, Any]:
    if stage == "hf":
        return run_hf(args)
    if stage == "kernels":
        return run_kernels(args)
    return run_engine_stage(stage, args)


_PASS = ("tiny", "num_layers", "prefill_len", "max_model_len", "decode_output", "long_len",
         "long_max_model_len", "offline_prompts", "offline_input", "offline_output",
         "max_num_seqs", "long_max_num_seqs", "max_num_batched_tokens", "repeats",
         "long_repeats", "gpu_memory_utilization", "cpu_kv_cache_bytes", "kernel_reps",
         "kernel_prefill_len",
         "kernel_contexts", "kernel_splits", "model_dir", "vocab", "work_dir")  # fmt: skip


def _stage_cmd(args: argparse.Namespace, stage: str, out: str) -> list[str]:
    cmd = [sys.executable, "-m", "xlaserve.bench.long_context", "--stage", stage,
           "--stage-out", out]  # fmt: skip
    for k in _PASS:
        v = getattr(args, k)
        flag = f"--{k.replace('_', '-')}"
        if isinstance(v, bool):
            cmd += [flag] if v else []
        elif isinstance(v, list | tuple):
            cmd += [flag, *map(str, v)]
        elif v is not None:
            cmd += [flag, str(v)]
    return cmd


def _stage(args: argparse.Namespace, stage: str) -> dict[str, Any]:
    """Run one stage in this process (--in-process) or in a subprocess (default)."""
    out = os.path.join(args.work_dir, f"long-{stage}.json")
    inner = (lambda: run_stage(stage, args)) if args.in_process else None
    return run_bench_stage(inner, _stage_cmd(args, stage, out), out, args.stage_timeout)


def _get(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if a and b else None


# Spec HBM bandwidth (GB/s) by a substring of the GPU's name, first match wins (the PCIe / NVL
# H100s before the SXM one, whose name is "NVIDIA H100 80GB HBM3").
HBM_GBS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
)
DEFAULT_GBS = 4800.0  # an unknown or absent GPU: the H200's, the issue's machine


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi ("" without one); no CUDA context in this process
    (the stages run in child processes and need the memory)."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else ""


def spec_bandwidth_gbs(name: str) -> float:
    """HBM_GBS's figure for a GPU name, DEFAULT_GBS when none matches."""
    for key, gbs in HBM_GBS:
        if key in name:
            return gbs
    return DEFAULT_GBS


def issue_roofline(
    cfg: dict[str, Any], context: float, rate: float | None, copy: float | None
) -> dict[str, Any] | None:
    """The issue's roofline: every weight byte (16.1 GB for the 8B, the input embedding too) +
    the KV bytes at `context`, at the card's measured copy rate `copy` GB/s (the issue: 4.3 TB/s
    on the H200); rate's fraction of it. None without a copy rate."""
    if not copy:
        return None
    ent = roofline(cfg, context, rate, [copy])[f"{int(copy)}_gbs"]
    return {"copy_gbs": copy, "roofline_tokens_per_s": ent["roofline_tokens_per_s_all_weights"],
            "fraction": ent.get("fraction_all_weights")}  # fmt: skip


def derive_rows(stages: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The issue's rows from the stages' raw figures (None where a stage is missing)."""
    cfg = model_config(args)
    bws = [args.bandwidth_gbs, args.alt_bandwidth_gbs]
    bf, fp, hf, lng = (stages.get(s, {}) for s in ("bf16", "fp8kv", "hf", "ctx128k"))
    ttft = _get(bf, "long", "ttft_median_s")
    sdpa = _get(hf, "forward_median_s")
    ratio = _ratio(ttft, sdpa)
    rows: dict[str, Any] = {}
    rows["prefill30k"] = {
        "prompt_len": args.prefill_len,
        "xlaserve_ttft_s": ttft,
        "sdpa_forward_s": sdpa,
        "ratio_vs_sdpa": ratio,
        "goal": "<= 0.9",
        "meets_goal": None if ratio is None else ratio <= 0.9,
    }
    fl = stages.get("nosdpa", {})
    ttft_fl = _get(fl, "long", "ttft_median_s")
    rows["prefill30k"]["prefill_sdpa_off"] = {
        "xlaserve_ttft_s": ttft_fl,
        "ratio_vs_sdpa": _ratio(ttft_fl, sdpa),
        "ttft_vs_default": _ratio(ttft_fl, ttft),
        "offline_vs_default": _ratio(
            _get(fl, "offline", "output_tokens_per_s"), _get(bf, "offline", "output_tokens_per_s")
        ),
        "decode_vs_default": _ratio(
            _get(fl, "long", "decode", "decode_tokens_per_s"),
            _get(bf, "long", "decode", "decode_tokens_per_s"),
        ),
    }
    ctx = args.prefill_len + args.decode_output / 2  # the mean context over the decode
    rate = _get(bf, "long", "decode", "decode_tokens_per_s")
    roof = roofline(cfg, ctx, rate, bws)
    frac = _get(roof, f"{int(args.bandwidth_gbs)}_gbs", "fraction")
    copy = _get(bf, "copy_gbs")
    rate32 = _get(stages.get("splits32", {}), "long", "decode", "decode_tokens_per_s")
    rows["decode30k"] = {
        "prompt_len": args.prefill_len,
        "output_len": args.decode_output,
        "decode_tokens_per_s": rate,
        "roofline": roof,
        "fraction_of_roofline": frac,
        "goal": ">= 0.85",
        "meets_goal": None if frac is None else frac >= 0.85,
        "issue_definition": issue_roofline(cfg, ctx, rate, copy),
        "graph_max_kv_splits_32": {
            "decode_tokens_per_s": rate32,
            "ratio_vs_default": _ratio(rate32, rate),
            "fraction_of_roofline": _get(
                roofline(cfg, ctx, rate32, bws), f"{int(args.bandwidth_gbs)}_gbs", "fraction"
            ),
        },
    }
    rate_l = _get(lng, "long", "decode", "decode_tokens_per_s")
    rows["ctx128k"] = {
        "prompt_len": args.long_len,
        "max_model_len": args.long_max_model_len,
        "ttft_s": _get(lng, "long", "ttft_median_s"),
        "decode_tokens_per_s": rate_l,
        "num_kv_blocks": _get(lng, "num_kv_blocks"),
        "roofline": roofline(cfg, args.long_len + args.decode_output / 2, rate_l, bws),
        "issue_definition": issue_roofline(
            cfg, args.long_len + args.decode_output / 2, rate_l, copy
        ),  # fmt: skip
    }
    off_b, off_f = (_get(x, "offline", "output_tokens_per_s") for x in (bf, fp))
    blk_b, blk_f = _get(bf, "num_kv_blocks"), _get(fp, "num_kv_blocks")
    dec_f = _get(fp, "long", "decode", "decode_tokens_per_s")
    off_ratio, blk_ratio = _ratio(off_f, off_b), _ratio(blk_f, blk_b)
    rows["fp8kv"] = {
        "offline": {
            "num_prompts": args.offline_prompts,
            "input_len": args.offline_input,
            "output_len": args.offline_output,
            "bf16_output_tokens_per_s": off_b,
            "fp8_output_tokens_per_s": off_f,
            "ratio": off_ratio,
            "goal": ">= 1.0",
            "meets_goal": None if off_ratio is None else off_ratio >= 1.0,
        },
        "kv_blocks": {
            "bf16": blk_b,
            "fp8": blk_f,
            "ratio": blk_ratio,
            "goal": ">= 1.9",
            "meets_goal": None if blk_ratio is None else blk_ratio >= 1.9,
        },
        "decode30k": {
            "bf16_tokens_per_s": rate,
            "fp8_tokens_per_s": dec_f,
            "ratio": _ratio(dec_f, rate),
            "fp8_roofline": roofline(cfg, ctx, dec_f, bws, kv_dtype="fp8"),
        },
        "ttft30k": {"bf16_s": ttft, "fp8_s": _get(fp, "long", "ttft_median_s")},
    }
    return rows


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-json", default="long_context.json")
    ap.add_argument("--llama8b", action="store_true", help="Llama-3.1-8B shape (the default)")
    ap.add_argument("--tiny", action="store_true", help="the 8B config shrunk (CPU smoke test)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {STAGES}")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--in-process", action="store_true", help="no subprocess per stage (tests)")
    ap.add_argument("--stage-timeout", type=int, default=240)
    for name in SIZES["llama8b"]:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                        help=f"default {SIZES['llama8b'][name]} ({SIZES['tiny'][name]} --tiny)")  # fmt: skip
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="step token budget (default: the platform's offline default)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-repeats", type=int, default=1)
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="HBM GB/s of the roofline (default: the GPU's spec by its name, "
                         "HBM_GBS; 4800, the H200's, when unknown)")  # fmt: skip
    ap.add_argument("--alt-bandwidth-gbs", type=float, default=4300.0, help="also reported")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--cpu-kv-cache-bytes", type=int, default=64 * 1024 * 1024)
    ap.add_argument("--kernel-reps", type=int, default=None, help="default 10 (1 --tiny)")
    ap.add_argument("--kernel-contexts", type=int, nargs="*", default=None,
                    help="decode contexts (default 30000 131072; 40 --tiny)")  # fmt: skip
    ap.add_argument("--kernel-splits", type=int, nargs="*", default=None,
                    help=f"split-KV factors (default {KV_SPLITS}; 1 2 --tiny)")  # fmt: skip
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stage-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bandwidth_gbs is None:
        args.bandwidth_gbs = spec_bandwidth_gbs(gpu_name())

    mode = "tiny" if args.tiny else "llama8b"
    for name, value in SIZES[mode].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.kernel_reps is None:
        args.kernel_reps = 1 if args.tiny else 10
    if args.kernel_contexts is None:
        args.kernel_contexts = [40] if args.tiny else [30000, 131072]
    if args.kernel_splits is None:
        args.kernel_splits = [1, 2] if args.tiny else list(KV_SPLITS)
    bad = [s for s in args.kernel_splits if s < 1 or s > 64 or s & (s - 1)]
    if bad:
        ap.error(f"--kernel-splits must be powers of 2 in [1, 64], got {bad}")
    for long_len, mml, label in ((args.prefill_len, args.max_model_len, "prefill"),
                                 (args.long_len, args.long_max_model_len, "long")):  # fmt: skip
        if long_len + args.decode_output > mml:
            ap.error(f"--{label}-len {long_len} + --decode-output {args.decode_output} exceeds "
                     f"its max_model_len {mml}")  # fmt: skip
    if not os.path.exists("/proc/driver/nvidia/version"):  # CPU: Triton kernels interpreted
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.stage:  # a subprocess of the driver
        res = run_stage(args.stage, args)
        with open(args.stage_out, "w") as f:
            json.dump(res, f, indent=1)
        return 0

    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        ap.error(f"unknown stages {unknown}; choose from {list(STAGES)}")
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="long-context-")
    os.makedirs(args.work_dir, exist_ok=True)
    args.model_dir = write_model(args)
    args.vocab = model_config(args)["vocab_size"]
    result: dict[str, Any] = {"model": mode, "args": vars(args), "stages": {}, "rows": {}}

    def save() -> None:
        result["rows"] = derive_rows(result["stages"], args)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1, default=str)

    for stage in stages:
        print(f"== stage {stage}", flush=True)
        result["stages"][stage] = _stage(args, stage)
        save()
    rows = result["rows"]
    bw = f"{int(args.bandwidth_gbs)}_gbs"
    p, dcd, lng, fp = rows["prefill30k"], rows["decode30k"], rows["ctx128k"], rows["fp8kv"]
    print(
        f"prefill {args.prefill_len}: TTFT {_fmt(p['xlaserve_ttft_s'])} s vs SDPA "
        f"{_fmt(p['sdpa_forward_s'])} s = {_fmt(p['ratio_vs_sdpa'], '.2f')}x (goal <= 0.9)"
    )
    off = p["prefill_sdpa_off"]
    print(
        f"  with prefill_sdpa off: TTFT {_fmt(off['xlaserve_ttft_s'])} s = "
        f"{_fmt(off['ratio_vs_sdpa'], '.2f')}x SDPA, {_fmt(off['ttft_vs_default'], '.2f')}x the "
        f"default's; offline {_fmt(off['offline_vs_default'], '.2f')}x, decode "
        f"{_fmt(off['decode_vs_default'], '.2f')}x"
    )
    print(
        f"decode at {args.prefill_len}: {_fmt(dcd['decode_tokens_per_s'], '.1f')} tok/s, "
        f"roofline {_fmt(dcd['roofline'][bw]['roofline_tokens_per_s'], '.1f')} at "
        f"{int(args.bandwidth_gbs)} GB/s = {_fmt(dcd['fraction_of_roofline'], '.2f')} "
        "(goal >= 0.85)"
    )
    iss = dcd.get("issue_definition")
    if iss:
        print(
            f"  the issue's roofline (all weights + KV at the measured copy rate "
            f"{iss['copy_gbs']:.0f} GB/s): {_fmt(iss['roofline_tokens_per_s'], '.1f')} tok/s, "
            f"fraction {_fmt(iss['fraction'], '.2f')}"
        )
    print(
        "  with graph_max_kv_splits=32: "
        f"{_fmt(dcd['graph_max_kv_splits_32']['decode_tokens_per_s'], '.1f')} tok/s"
    )
    print(
        f"ctx {args.long_len}: TTFT {_fmt(lng['ttft_s'])} s, decode "
        f"{_fmt(lng['decode_tokens_per_s'], '.1f')} tok/s"
    )
    print(
        f"fp8 KV: offline {_fmt(fp['offline']['ratio'], '.2f')}x bf16, blocks "
        f"{_fmt(fp['kv_blocks']['ratio'], '.2f')}x, decode at {args.prefill_len} "
        f"{_fmt(fp['decode30k']['ratio'], '.2f')}x"
    )
    for stage, res in result["stages"].items():
        if "error" in res:
            print(f"stage {stage}: {res['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
