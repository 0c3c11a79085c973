"""GPU benchmark on a Llama-3.1-8B shape: xlaserve (torch backend: Triton attention + decode CUDA
graphs) beside HF transformers `generate`, and backend="xla" where it imports.

The model is a config.json (32 layers, hidden 4096, intermediate 14336, 32 q / 8 kv heads, head_dim
128, vocab 128256, llama3 rope scaling) with random bf16 weights (xlaserve: load_format="dummy";
HF: built from the same config on the GPU) and a tiny BPE tokenizer (prompts are token ids).

Each measurement runs in its own subprocess (so one failure or timeout leaves the others, and GPU
memory is returned between systems); the parent merges their JSON into ``--output-json`` after each
stage. Figures:
- ``ttft_cold_s`` / ``ttft_warm_s``: ``LLM(...)`` to the first generated token, in a fresh process
  with an empty Triton cache (cold) and again with the cache filled (warm);
- ``batch1``: 128 prompt tokens, 256 output tokens (greedy, EOS ignored), median of repeats:
  end-to-end tokens/s, and the decode rate 255 / (t(256 tokens) - t(1 token));
- ``offline_256_256`` / ``offline_1024_128``: N random prompts, all output tokens / wall time;
- ``graph_replay_ms``: GPU time of one decode graph replay per batch bucket (CUDA events), to
  split a decode step into GPU time and host overhead.

Run: ``python -m xlaserve.bench.gpu_bench --output-json out.json`` (on a CUDA machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from xlaserve.bench.common import wait_background_compiles

LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}

_CORPUS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "The quick brown fox jumps over the lazy dog 0123456789 !?.,;:-+*/=()[]{}<>",
]


TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}


def write_model_dir(
    path: str, num_layers: int = 32, tiny: bool = False, vocab_size: int | None = None
) -> str:
    """config.json (Llama-3.1-8B shape, `num_layers` layers) + a small BPE tokenizer.json whose
    vocab covers the model's (added tokens past the trained merges). vocab_size: overrides
    the shape's (e.g. tiny layers with the real 128,256-token vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(path, exist_ok=True)
    cfg = dict(LLAMA_8B, num_hidden_layers=num_layers)
    if tiny:  # smoke-test shape for machines without a GPU
        cfg.update(TINY)
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    # Every id of the model's vocab decodes to text (random prompts and random-weight outputs
    # use all of it): ids past the trained BPE are added tokens "<tN>". With ids that decode
    # to nothing the incremental detokenizer never advances its window, which is unrealistic.
    tok.add_tokens([f"<t{i}>" for i in range(tok.get_vocab_size(), cfg["vocab_size"])])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
            },
            f,
        )
    return path


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    g = np.random.default_rng(seed)
    return g.integers(2, vocab, size=(n, length)).tolist()


def _vocab(args: argparse.Namespace) -> int:
    return TINY["vocab_size"] if args.tiny else LLAMA_8B["vocab_size"]


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# ---- stages (each runs in a subprocess) ------------------------------------------------------


def stage_ttft(args: argparse.Namespace, keep: bool = False) -> dict[str, Any]:
    """LLM(...) -> first token of one 128-token prompt (cold or warm by the Triton cache the
    caller hands over). keep=True also returns the LLM under "_llm"."""
    t_import = time.perf_counter()
    from xlaserve import LLM, SamplingParams

    import_s = time.perf_counter() - t_import
    t0 = time.perf_counter()
    llm = LLM(**_llm_kwargs(args))
    init_s = time.perf_counter() - t0
    p = _prompts(1, 128, _vocab(args), 1)[0]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
    ttft = time.perf_counter() - t0
    res: dict[str, Any] = {"import_s": import_s, "init_s": init_s, "ttft_s": ttft}
    if keep:
        res["_llm"] = llm
    return res


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        model=args.model_dir,
        load_format="dummy",
        dtype="bfloat16",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=0.9,
        enforce_eager=args.enforce_eager,
    )
    if args.backend != "torch":
        kw["backend"] = args.backend
    if args.backend == "xla":  # batch-1 only: a small bucket set
        kw.update(max_num_seqs=1, max_num_batched_tokens=128, enforce_eager=True)
        # The XLA GPU attention is the jnp reference (per-token page gather, O(T x max_len)
        # temporaries): a 1024-token context bounds them; the benchmark needs 512.
        kw.update(max_model_len=1024)
    return kw


def _batch1(llm: Any, repeats: int, vocab: int) -> dict[str, Any]:
    from xlaserve import SamplingParams

    p = {"prompt_token_ids": _prompts(1, 128, vocab, 2)[0]}
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=256, min_tokens=256, temperature=0.0, ignore_eos=True)
    llm.generate([p], full, use_tqdm=False)  # warm-up (compiles anything still cold)
    wait_background_compiles(llm)  # XLA: whatever the warm-up left compiling in the background
    t1s, t256s = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate([p], one, use_tqdm=False)
        t1s.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = llm.generate([p], full, use_tqdm=False)
        t256s.append(time.perf_counter() - t)
        assert len(out[0].outputs[0].token_ids) == 256
    t1, t256 = _median(t1s), _median(t256s)
    decode = 255 / (t256 - t1)
    return {
        "prompt_len": 128,
        "output_len": 256,
        "repeats": repeats,
        "t_1_token_s": t1s,
        "t_256_tokens_s": t256s,
        "e2e_tokens_per_s": 256 / t256,
        "decode_tokens_per_s": decode,
        "roofline_tokens_per_s": 268.0,
        "decode_ratio_to_roofline": decode / 268.0,
    }


def _warm_request_buckets(llm: Any, vocab: int) -> None:
    """One short request batch (the timed rows' sampling) per power-of-2 batch size up to
    max_num_seqs, then every background compile: XLA's larger token buckets and any sampler
    specialization a request bucket meets for the first time, which would otherwise compile
    inside a timed run, competing with it for the host. (These greedy ignore_eos rows take the
    all-greedy sampler compiled at start-up, so for them it is the token buckets.)"""
    from xlaserve import SamplingParams

    sp = SamplingParams(max_tokens=2, min_tokens=2, temperature=0.0, ignore_eos=True)
    b, most = 1, llm.llm_engine.config.scheduler.max_num_seqs
    while True:
        prompts = [{"prompt_token_ids": p} for p in _prompts(min(b, most), 8, vocab, 7)]
        llm.generate(prompts, sp, use_tqdm=False)
        if b >= most:
            break
        b *= 2
    wait_background_compiles(llm)


def _in_process(llm: Any) -> bool:  # noqa: ANN401
    """The engine core runs in this process (its scheduler and runner can be looked into)."""
    from xlaserve.engine.llm_engine import LLMEngine

    return isinstance(llm.llm_engine, LLMEngine)


def _offline(llm: Any, n: int, inp: int, out: int, repeats: int, vocab: int) -> dict[str, Any]:
    from xlaserve import SamplingParams

    _warm_request_buckets(llm, vocab)

    engine = llm.llm_engine
    inner = engine.step
    counter = {"steps": 0, "time": 0.0}

    def timed_step(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        r = inner(*a, **kw)
        counter["time"] += time.perf_counter() - t
        counter["steps"] += 1
        return r

    engine.step = timed_step
    # Host-time split (where a step's wall time goes): each wrapped call's total seconds.
    parts: dict[str, float] = {}
    sched: list[tuple[float, int, int]] = []  # (start, scheduled tokens, requests) per step
    undo = []
    # (The engine core in its own process has none of these here: the wall time only.)
    local = _in_process(llm)
    scheduler = engine.scheduler if local else None
    runner = engine.runner if local else None
    for owner, name in ((scheduler, "schedule"), (engine.core if local else None, "_process"),
                        (runner, "execute"), (runner, "launch"),
                        (runner, "finish")):  # fmt: skip
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            continue

        def wrapped(*a, _fn=fn, _name=name, **kw):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                so = _fn(*a, **kw)
                if _name == "schedule" and so is not None:
                    sched.append((t0, so.total_num_scheduled_tokens, len(so.num_scheduled_tokens)))
                return so
            finally:
                parts[_name] = parts.get(_name, 0.0) + time.perf_counter() - t0

        setattr(owner, name, wrapped)
        undo.append((owner, name))
    sp = SamplingParams(max_tokens=out, min_tokens=out, temperature=0.0, ignore_eos=True)
    walls, toks = [], []
    hot: list[dict[str, Any]] = []
    try:
        for r in range(repeats):
            prompts = [{"prompt_token_ids": p} for p in _prompts(n, inp, vocab, 100 + r)]
            counter.update(steps=0, time=0.0)
            sched.clear()
            prof = _cprofile_start(r == repeats - 1)
            t = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            walls.append(time.perf_counter() - t)
            hot = _cprofile_stop(prof)
            toks.append(sum(len(o.outputs[0].token_ids) for o in res))
            assert toks[-1] == n * out, toks[-1]
    finally:
        engine.step = inner
        for owner, name in undo:
            delattr(owner, name)
    wall = _median(walls)
    return {
        "num_prompts": n,
        "input_len": inp,
        "output_len": out,
        "repeats": repeats,
        "wall_s": walls,
        "output_tokens_per_s": n * out / wall,
        "total_tokens_per_s": n * (inp + out) / wall,
        "steps_last_run": counter["steps"],
        "mean_step_ms_last_run": 1e3 * counter["time"] / max(counter["steps"], 1),
        # ms per step inside each part (all runs): schedule, runner launch / finish (finish
        # waits for the device) or execute, engine output processing.
        "per_step_ms": {k: 1e3 * v / max(counter["steps"], 1) / repeats for k, v in parts.items()},
        # Last run's steps (start of one schedule to the next; async: one step ahead) split
        # into pure-decode steps (one token per request) and the rest: (count, seconds).
        "step_split_last_run": _step_split(sched),
        "cprofile_last_run": hot,
    }


def _step_split(sched: list[tuple[float, int, int]]) -> dict[str, Any]:
    gaps = [(sched[i + 1][0] - sched[i][0], t, b) for i, (_, t, b) in enumerate(sched[:-1])]
    dec = [g for g, t, b in gaps if t == b]
    other = [g for g, t, b in gaps if t != b]
    return {
        "decode_steps": (len(dec), round(sum(dec), 3)),
        "other_steps": (len(other), round(sum(other), 3)),
        "decode_step_ms_median": round(1e3 * _median(dec), 3) if dec else None,
    }


def _cprofile_start(on: bool) -> Any:
    """XLASERVE_BENCH_CPROFILE=1: profile the (last) offline run with cProfile, to find where
    host time goes and where the host waits for the device (synchronize / tolist / copy_)."""
    if not (on and os.environ.get("XLASERVE_BENCH_CPROFILE") == "1"):
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def _cprofile_stop(prof: Any, top: int = 40) -> list[dict[str, Any]]:
    """The `top` functions by own time: ms total, calls, cumulative ms."""
    if prof is None:
        return []
    import pstats

    prof.disable()
    rows = [
        {
            "fn": f"{os.path.basename(file)}:{line}:{name}",
            "tottime_ms": round(1e3 * tt, 1),
            "cumtime_ms": round(1e3 * ct, 1),
            "calls": nc,
        }
        for (file, line, name), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()
    ]
    rows.sort(key=lambda r: -r["tottime_ms"])
    return rows[:top]


def _graph_replay_ms(llm: Any) -> dict[str, float]:
    """GPU time of one replay of each captured decode graph (CUDA events, median of 20)."""
    import torch

    step = getattr(llm.llm_engine.runner, "cuda_step", None)
    if step is None or not step.graphs:
        return {}
    out = {}
    for b, (g, _, _) in sorted(step.graphs.items()):
        ms = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            ms.append(s.elapsed_time(e))
        out[str(b)] = _median(ms)
    return out


def _profile_decode(llm: Any, batch: int, vocab: int) -> dict[str, Any]:
    """Host-side split of decode steps at `batch` requests: scheduler+detok vs runner.execute."""
    from xlaserve import SamplingParams

    engine = llm.llm_engine
    runner = engine.runner
    acc = {"exec": 0.0, "n": 0}
    # Synchronous steps call execute; async ones launch + finish (a step = one execute / launch).
    wrapped = [n for n in ("execute", "launch", "finish") if hasattr(runner, n)]

    def timing(name: str, inner: Any) -> Any:
        def timed(arg):  # noqa: ANN001, ANN202
            t = time.perf_counter()
            r = inner(arg)
            acc["exec"] += time.perf_counter() - t
            acc["n"] += name != "finish"
            return r

        return timed

    for name in wrapped:
        setattr(runner, name, timing(name, getattr(runner, name)))
    sp = SamplingParams(max_tokens=64, min_tokens=64, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(batch, 16, vocab, 7)]
    try:
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t
    finally:
        for name in wrapped:
            delattr(runner, name)  # the instance attribute; the class's method shows again
    return {
        "batch": batch,
        "steps": acc["n"],
        "wall_per_step_ms": 1e3 * wall / max(acc["n"], 1),
        # execute, or launch + finish under async scheduling (finish includes the device wait)
        "runner_execute_per_step_ms": 1e3 * acc["exec"] / max(acc["n"], 1),
    }


def stage_xlaserve(args: argparse.Namespace) -> dict[str, Any]:
    """Warm start (the caller ran the cold one first), then every throughput figure on that LLM."""
    warm = stage_ttft(args, keep=True)
    llm = warm.pop("_llm")
    res: dict[str, Any] = {"ttft_warm": warm}
    vocab = _vocab(args)
    runner = llm.llm_engine.runner
    step = getattr(runner, "cuda_step", None)
    res["attention_backend"] = getattr(runner, "attn_backend_name", None)
    res["async_scheduling"] = getattr(llm.llm_engine, "_async", None)
    res["num_kv_blocks"] = llm.llm_engine.get_stats().num_total_blocks
    res["graph_buckets"] = sorted(step.graphs) if step is not None else []
    res["graph_capture_s"] = step.capture_seconds if step is not None else None
    _save_partial(args, res)
    res["batch1"] = _batch1(llm, args.repeats, vocab)
    _save_partial(args, res)
    if args.backend == "xla":
        return res
    res["graph_replay_ms"] = _graph_replay_ms(llm)
    try:
        res["kernel_profile"] = _kernel_profile(llm, (1, args.max_num_seqs))
    except Exception as e:  # noqa: BLE001 - the profile is a diagnostic, not a figure
        res["kernel_profile"] = {"error": repr(e)}
    _save_partial(args, res)
    res["decode_profile"] = [_profile_decode(llm, b, vocab) for b in (1, args.max_num_seqs)]
    _save_partial(args, res)
    if args.num_prompts <= 0:
        return res
    res["offline_256_256"] = _offline(llm, args.num_prompts, 256, 256, args.offline_repeats, vocab)
    _save_partial(args, res)
    res["offline_1024_128"] = _offline(llm, args.num_prompts_long, 1024, 128, 1, vocab)
    return res


# Variants of the xlaserve stage, each in its own subprocess: extra LLM(...) arguments and what to
# measure ("batch1": the batch-1 decode figure; "offline": 256/256 throughput; "repetitive":
# batch-1 on prompts that repeat a 16-token phrase, for n-gram speculation on dummy weights).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "int8": ({"quantization": "int8"}, "batch1"),
    "int4": ({"quantization": "int4"}, "batch1"),
    "fp8": ({"quantization": "fp8"}, "batch1"),
    "kv_fp8": ({"kv_cache_dtype": "fp8"}, "offline"),
    "kv_int8": ({"kv_cache_dtype": "int8"}, "offline"),
    "ngram_base": ({}, "repetitive"),
    "ngram": ({"speculative_config": NGRAM}, "repetitive"),
    "xla_batch": ({"backend": "xla"}, "batch1+offline"),
    # The XLA backend as a user runs it: the xlaserve stage's arguments, compiled buckets, no
    # bucket or eager override (issue 33's side-by-side figure; --stages xlaserve,xla_user).
    "xla_user": ({"backend": "xla", "max_model_len": 2048}, "batch1+offline"),
    # Its batch-1 row alone (A/Bs of the decode GEMV tiles against the `b1` torch row).
    "xla_user_b1": ({"backend": "xla", "max_model_len": 2048}, "batch1"),
    "xla_user_offline": ({"backend": "xla", "max_model_len": 2048}, "offline"),
    # xla_user with the Pallas decode GEMV in the Flax linears forced on (issue 33; xla_user
    # itself runs KernelConfig.xla_decode_gemv's default, or XLASERVE_XLA_DECODE_GEMV if set).
    "xla_user_gemv": (
        {"backend": "xla", "max_model_len": 2048, "xla_decode_gemv": "on"},
        "batch1+offline",
    ),
    # The engine core in its own process (the front detokenizes and builds outputs beside the
    # core's steps): offline and batch-1 rows against xla_user's / the xlaserve stage's.
    "xla_user_proc": (
        {"backend": "xla", "max_model_len": 2048, "engine_process": True},
        "batch1+offline",
    ),
    "torch_proc": ({"engine_process": True}, "batch1+offline"),
    # xla_user with a quantized KV cache (the Pallas GPU attention dequantizing in registers):
    # its offline row against xla_user's.
    "xla_kv_fp8": ({"backend": "xla", "max_model_len": 2048, "kv_cache_dtype": "fp8"}, "offline"),
    "xla_kv_int8": (
        {"backend": "xla", "max_model_len": 2048, "kv_cache_dtype": "int8"},
        "offline",
    ),
    "sync": ({"async_scheduling": "off"}, "offline"),
    "async": ({"async_scheduling": "on"}, "offline"),
    "sync_b1": ({"async_scheduling": "off"}, "batch1"),
    "async_b1": ({"async_scheduling": "on"}, "batch1"),
    # Batch-1 decode A/B of this session's decode changes (issue 7), each on / off by env.
    "b1": ({}, "batch1"),
    "b1_no_pdl": ({}, "batch1"),
    "b1_no_gemv": ({}, "batch1"),
    "b1_no_gate_act": ({}, "batch1"),
    "b1_splits8": ({}, "batch1"),
    "b1_base": ({}, "batch1"),
    "b1_no_prefetch": ({}, "batch1"),
    "b1_no_fused_greedy": ({}, "batch1"),
    # Offline 256 / 256 at other engine limits (max_num_seqs / max_num_batched_tokens; the
    # stage default is 256 / 8192; "default": unset, i.e. the platform's offline defaults).
    "offline_default": ({"max_num_seqs": None, "max_num_batched_tokens": None}, "offline"),
    "offline_s256": ({}, "offline"),
    "offline_s256_no_greedy": ({}, "offline"),
    "offline_s512": ({"max_num_seqs": 512, "max_num_batched_tokens": 16384}, "offline"),
    "offline_s1024": ({"max_num_seqs": 1024, "max_num_batched_tokens": 16384}, "offline"),
    # XLA attention A/B on the GPU (issue 3): the jnp reference against the Pallas GPU kernel.
    "xla_batch_ref": ({"backend": "xla"}, "batch1+offline"),
    "xla_batch_pallas": ({"backend": "xla"}, "batch1+offline"),
}
# Environment of a variant's subprocess (knobs that are not LLM arguments).
VARIANT_ENV: dict[str, dict[str, str]] = {
    "b1_no_pdl": {"XLASERVE_PDL": "0"},
    "b1_no_gemv": {"XLASERVE_DENSE_GEMV": "0"},
    "b1_no_gate_act": {"XLASERVE_GATE_ACT_GEMV": "0"},
    "b1_splits8": {"XLASERVE_GRAPH_MAX_KV_SPLITS": "8"},
    "b1_no_prefetch": {"XLASERVE_GEMV_PREFETCH": "0"},
    "b1_no_fused_greedy": {"XLASERVE_FUSED_GREEDY": "0"},
    "offline_s256_no_greedy": {"XLASERVE_FUSED_GREEDY": "0"},
    "b1_base": {
        "XLASERVE_PDL": "0",
        "XLASERVE_DENSE_GEMV": "0",
        "XLASERVE_FUSED_ROPE_KV": "0",
        "XLASERVE_GATE_ACT_GEMV": "0",
        "XLASERVE_GEMV_PREFETCH": "0",
    },
    "xla_batch_ref": {"XLASERVE_RPA_IMPL": "reference"},
    "xla_batch_pallas": {"XLASERVE_RPA_IMPL": "pallas_gpu"},
}


def _repetitive(llm: Any, repeats: int, vocab: int) -> dict[str, Any]:
    """Batch 1, 4 prompts of a 16-token phrase repeated 8 times, 256 greedy tokens each."""
    from xlaserve import SamplingParams

    prompts = [{"prompt_token_ids": p * 8} for p in _prompts(4, 16, vocab, 11)]
    sp = SamplingParams(max_tokens=256, min_tokens=256, temperature=0.0, ignore_eos=True)
    eng = llm.llm_engine
    llm.generate(prompts[:1], sp, use_tqdm=False)  # warm-up
    d0, a0, n0 = eng.spec_num_draft_tokens, eng.spec_num_accepted_tokens, eng.spec_num_drafts
    rates, outs = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        outs = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        rates.append(sum(map(len, outs)) / (time.perf_counter() - t))
    drafts = eng.spec_num_draft_tokens - d0
    acc = eng.spec_num_accepted_tokens - a0
    steps = eng.spec_num_drafts - n0
    return {
        "tokens_per_s_runs": rates,
        "tokens_per_s": _median(rates),
        "draft_tokens": drafts,
        "acceptance_rate": acc / drafts if drafts else 0.0,
        "mean_acceptance_length": 1 + acc / steps if steps else 1.0,
        # the greedy outputs, so the parent can check spec == plain token for token
        "outputs_head": [o[:64] for o in outs],
    }


def stage_variant(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    extra, what = VARIANTS[args.variant]
    from xlaserve import LLM

    kw = _llm_kwargs(args)
    kw.update(extra)
    # The old batched-XLA stages: a modest bucket set, eager, 256 prompts (xla_user: as a user).
    small_xla = kw.get("backend") == "xla" and not args.variant.startswith("xla_user")
    if small_xla:
        kw.update(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024)
        kw.update(enforce_eager=True)
    t = time.perf_counter()
    llm = LLM(**kw)
    res: dict[str, Any] = {
        "variant": args.variant,
        "llm_kwargs": {k: str(v) for k, v in extra.items()},
    }
    res["init_s"] = time.perf_counter() - t
    if wait_background_compiles(llm):  # XLA: larger token buckets compile after ready
        res["all_compiled_s"] = time.perf_counter() - t
    res["num_kv_blocks"] = llm.llm_engine.get_stats().num_total_blocks
    sc = llm.llm_engine.config.scheduler
    res["max_num_seqs"], res["max_num_batched_tokens"] = sc.max_num_seqs, sc.max_num_batched_tokens
    _save_partial(args, res)
    vocab = _vocab(args)
    if what.startswith("batch1"):
        res["batch1"] = _batch1(llm, args.repeats, vocab)
        _save_partial(args, res)
        if kw.get("backend") != "xla" and _in_process(llm):
            # CUDA-event time of one replay per decode graph (a steadier A/B than tok/s).
            res["graph_replay_ms"] = _graph_replay_ms(llm)
            res["kernel_profile"] = _kernel_profile(llm, buckets=(1,))
            _save_partial(args, res)
    if what == "repetitive":
        res["repetitive"] = _repetitive(llm, args.repeats, vocab)
    if what.endswith("offline"):
        n = min(args.num_prompts, 256) if small_xla else args.num_prompts
        res["offline_256_256"] = _offline(llm, n, 256, 256, 1, vocab)
    return res


def kernel_rows(prof: Any, reps: int, width: int) -> list[tuple[float, float, str]]:
    """(GPU us per rep, calls per rep, kernel name[:width]) per kernel of a torch.profiler run
    over `reps` repetitions, largest first."""
    rows = []
    for e in prof.key_averages():
        t_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t_us:
            rows.append((t_us / reps, e.count / reps, e.key[:width]))
    rows.sort(reverse=True)
    return rows


def _kernel_profile(llm: Any, buckets: tuple[int, ...] = (1, 256), top: int = 12) -> dict[str, Any]:
    """Per-kernel GPU time inside one decode graph replay (torch.profiler, CUPTI), top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step = getattr(llm.llm_engine.runner, "cuda_step", None)
    out: dict[str, Any] = {}
    for b in buckets:
        if step is None or b not in step.graphs:
            continue
        g = step.graphs[b][0]
        g.replay()
        torch.cuda.synchronize()
        reps = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                g.replay()
            torch.cuda.synchronize()
        rows = [(u, int(c), k) for u, c, k in kernel_rows(prof, reps, 90)]
        out[str(b)] = {
            "total_us": sum(r[0] for r in rows),
            "kernels": len(rows),
            "launches": sum(r[1] for r in rows),
            "top": [{"us": round(u, 1), "calls": c, "name": k} for u, c, k in rows[:top]],
        }
    return out


def stage_hf(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    fields = {k: v for k, v in LLAMA_8B.items() if k != "architectures"}
    fields.update(TINY if args.tiny else {}, num_hidden_layers=args.num_layers)
    cfg = transformers.LlamaConfig(**fields)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    res: dict[str, Any] = {"transformers": transformers.__version__, "build_s": 0.0}
    _sync()
    res["build_s"] = time.perf_counter() - t
    model.generation_config.eos_token_id = None
    vocab = _vocab(args)

    def gen(prompts: list[list[int]], n: int) -> float:
        ids = torch.tensor(prompts, device=dev)
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        _sync()
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t0

    p1 = _prompts(1, 128, vocab, 2)
    gen(p1, 8)  # warm-up
    t1 = [gen(p1, 1) for _ in range(args.hf_repeats)]
    t256 = [gen(p1, 256) for _ in range(args.hf_repeats)]
    res["batch1"] = {
        "t_1_token_s": t1,
        "t_256_tokens_s": t256,
        "e2e_tokens_per_s": 256 / _median(t256),
        "decode_tokens_per_s": 255 / (_median(t256) - _median(t1)),
    }
    _save_partial(args, res)
    for key, n, inp, out in (
        ("offline_256_256", args.hf_batch, 256, 256),
        ("offline_1024_128", args.hf_batch_long, 1024, 128),
    ):
        dt = gen(_prompts(n, inp, vocab, 100), out)
        res[key] = {
            "num_prompts": n,
            "batch": n,
            "input_len": inp,
            "output_len": out,
            "wall_s": dt,
            "output_tokens_per_s": n * out / dt,
        }
        _save_partial(args, res)
    return res


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _save_partial(args: argparse.Namespace, res: dict[str, Any]) -> None:
    if args.stage_out:
        with open(args.stage_out, "w") as f:
            json.dump(res, f, indent=1)


# ---- driver ---------------------------------------------------------------------------------


def _run_stage(
    name: str, stage: str, args: argparse.Namespace, extra: list[str], env: dict[str, str]
) -> dict[str, Any]:
    os.makedirs(args.stage_dir or args.work_dir, exist_ok=True)
    out = os.path.join(args.stage_dir or args.work_dir, f"{name}.json")
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, "-m", "xlaserve.bench.gpu_bench", "--stage", stage, "--stage-out", out]
    cmd += ["--model-dir", args.model_dir, "--num-layers", str(args.num_layers)]
    cmd += ["--tiny"] if args.tiny else []
    for k in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "repeats",
        "offline_repeats",
        "num_prompts",
        "num_prompts_long",
        "hf_repeats",
        "hf_batch",
        "hf_batch_long",
    ):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    cmd += extra
    t = time.perf_counter()
    print(f"== {name}: {' '.join(cmd[3:])}", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.stage_timeout.get(name, 300))
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    res: dict[str, Any] = {}
    if os.path.exists(out):
        with open(out) as f:
            res = json.load(f)
    res["returncode"] = rc
    res["stage_wall_s"] = time.perf_counter() - t
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-json", default="gpu_bench.json")
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stage-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--stage-dir", default=None, help="where each stage writes its JSON")
    ap.add_argument("--num-layers", type=int, default=32)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--variant", default=None, choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help="tiny shape (CPU smoke test)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--offline-repeats", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--num-prompts-long", type=int, default=500)
    ap.add_argument("--hf-repeats", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=256)
    ap.add_argument("--hf-batch-long", type=int, default=64)
    ap.add_argument(
        "--stages",
        default="cold,xlaserve,hf,xla",
        help="comma list of: cold, xlaserve, hf, xla, eager, " + ", ".join(VARIANTS),
    )
    ap.add_argument(
        "--timeouts",
        default="cold=150,xlaserve=330,hf=200,xla=200,eager=120,xla_batch=240",
        help="per-stage timeouts in seconds",
    )
    args = ap.parse_args(argv)
    args.stage_timeout = {
        k: float(v) for k, v in (kv.split("=") for kv in args.timeouts.split(","))
    }
    if args.stage:  # child process
        fn = {
            "ttft": stage_ttft,
            "xlaserve": stage_xlaserve,
            "hf": stage_hf,
            "variant": stage_variant,
        }[args.stage]
        res = fn(args)
        _save_partial(args, res)
        return 0

    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="gpu_bench_")
    if args.model_dir is None:
        args.model_dir = write_model_dir(
            os.path.join(args.work_dir, "llama8b"), args.num_layers, args.tiny
        )
    import torch

    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "model": dict(LLAMA_8B, num_hidden_layers=args.num_layers, **(TINY if args.tiny else {})),
        "argv": sys.argv,
    }

    def save() -> None:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cold_cache = os.path.join(args.work_dir, "triton_cache")
    env["TRITON_CACHE_DIR"] = cold_cache  # empty now: the first stage starts cold
    stages = args.stages.split(",")
    if "cold" in stages:
        report["ttft_cold"] = _run_stage("cold", "ttft", args, [], env)
        save()
    if "xlaserve" in stages:
        report["xlaserve"] = _run_stage("xlaserve", "xlaserve", args, [], env)
        save()
    if "eager" in stages:
        report["xlaserve_eager"] = _run_stage(
            "eager", "xlaserve", args, ["--enforce-eager", "--num-prompts", "0"], env
        )
        save()
    if "hf" in stages:
        report["hf"] = _run_stage("hf", "hf", args, [], env)
        save()
    if "xla" in stages:
        try:
            import xlaserve.backends_xla.runner  # noqa: F401

            report["xla"] = _run_stage("xla", "xlaserve", args, ["--backend", "xla"], env)
        except Exception as e:  # noqa: BLE001 - report why it was not measured
            report["xla"] = {"not_measured": f"backends_xla.runner does not import: {e!r}"}
        save()
    for name in stages:
        if name in VARIANTS:
            venv = dict(env, **VARIANT_ENV.get(name, {}))
            report[name] = _run_stage(name, "variant", args, ["--variant", name], venv)
            save()
    _print_table(report)
    return 0


def _print_table(r: dict[str, Any]) -> None:
    def g(*keys: str) -> Any:
        x: Any = r
        for k in keys:
            if not isinstance(x, dict) or k not in x:
                return None
            x = x[k]
        return x

    rows = [
        ("ttft cold (s)", g("ttft_cold", "ttft_s"), None),
        # Cold when the "cold" stage did not run first (the Triton cache starts empty).
        ("ttft xlaserve stage (s)", g("xlaserve", "ttft_warm", "ttft_s"), None),
        ("b1 decode tok/s", g("xlaserve", "batch1", "decode_tokens_per_s"),
         g("hf", "batch1", "decode_tokens_per_s")),
        ("b1 e2e tok/s", g("xlaserve", "batch1", "e2e_tokens_per_s"),
         g("hf", "batch1", "e2e_tokens_per_s")),
        ("256/256 out tok/s", g("xlaserve", "offline_256_256", "output_tokens_per_s"),
         g("hf", "offline_256_256", "output_tokens_per_s")),
        ("1024/128 out tok/s", g("xlaserve", "offline_1024_128", "output_tokens_per_s"),
         g("hf", "offline_1024_128", "output_tokens_per_s")),
        ("xla b1 decode tok/s", g("xla", "batch1", "decode_tokens_per_s"), None),
        ("xla ttft (s)", g("xla", "ttft_warm", "ttft_s"), None),
    ]  # fmt: skip
    # One row per figure of each variant stage (VARIANTS: what it measures).
    figures = {
        "batch1": [("b1 decode tok/s", ("batch1", "decode_tokens_per_s"))],
        "offline": [("256/256 tok/s", ("offline_256_256", "output_tokens_per_s"))],
        "repetitive": [("rep. b1 tok/s", ("repetitive", "tokens_per_s")),
                       ("acc. length", ("repetitive", "mean_acceptance_length"))],
    }  # fmt: skip
    for name, (_, what) in VARIANTS.items():
        if name not in r:  # a variant this run did not measure: no row of dashes
            continue
        for part in what.split("+"):
            for label, keys in figures[part]:
                rows.append((f"{name} {label}", g(name, *keys), None))
    print(f"{'metric':<28}{'xlaserve':>12}{'hf':>12}")
    for name, a, b in rows:
        fa = f"{a:12.2f}" if isinstance(a, int | float) else f"{'-':>12}"
        fb = f"{b:12.2f}" if isinstance(b, int | float) else f"{'-':>12}"
        print(f"{name:<28}{fa}{fb}")


if __name__ == "__main__":
    sys.exit(main())
