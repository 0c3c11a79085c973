#!/usr/bin/env python
"""GPU probe: where the 30k-token prefill's GPU time goes, ours against transformers' SDPA
forward of the same prompt length (issue 24's TTFT goal: <= 0.9x transformers).

    OUT=dir python bench/gpu_probes/prefill_profile.py [PROMPT_LEN] [SIDES]
    # SIDES: comma list of transformers, engine, engine_sdpa (prefill_sdpa="on");
    # default all three -> $OUT/prefill_profile.json

Llama-3.1-8B shape, dummy bf16 weights. First transformers (LlamaForCausalLM, sdpa attention,
logits_to_keep=1, as long_context.py's hf stage), then our engine (long_context's settings:
`LLM` defaults, max_model_len 32768), each: one warm-up forward, then one fresh prompt timed
(wall) and one profiled (torch.profiler, CUDA kernels). Per side: wall seconds, GPU busy
seconds, GPU time by kind (GEMM / attention / other, by kernel name: `kind`) and the top
kernels. The profiled run is not a timing figure (the profiler adds host work).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from xlaserve.bench import gpu_bench as gb

# Kernel-name substrings by kind (lower case); the first match wins, in this order.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attn", "attention", "flash", "fmha", "sdpa", "paged", "prefill")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "sm90_")),
)


# Llama 3.1's own position limit (as long_context.py's config): 32k prompts fit.
CONFIG: dict[str, Any] = dict(gb.LLAMA_8B, max_position_embeddings=131072)


def kind(name: str) -> str:
    low = name.lower()
    for k, keys in KINDS:
        if any(s in low for s in keys):
            return k
    return "other"


def _summary(prof: Any, wall: float) -> dict[str, Any]:  # noqa: ANN401 - torch profiler
    rows = gb.kernel_rows(prof, 1, 120)
    by_kind: dict[str, float] = {}
    for us, _, name in rows:
        by_kind[kind(name)] = by_kind.get(kind(name), 0.0) + us / 1e3
    return {
        "wall_s": wall,
        "gpu_ms": sum(r[0] for r in rows) / 1e3,
        "gpu_ms_by_kind": {k: round(v, 2) for k, v in sorted(by_kind.items())},
        "kernels": [
            {"ms": round(u / 1e3, 2), "calls": int(c), "kind": kind(k), "name": k}
            for u, c, k in rows[:25]
        ],
    }


def _measure(run: Any) -> dict[str, Any]:  # noqa: ANN401 - run(seed) -> seconds
    """A warm-up run, a timed one (wall) and a profiled one, each on a fresh prompt."""
    run(1)
    wall = run(2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(3)
    return _summary(prof, wall)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def hf_side(n: int) -> dict[str, Any]:
    import transformers

    cfg_fields = {k: v for k, v in CONFIG.items() if k != "architectures"}
    cfg = transformers.LlamaConfig(**cfg_fields, attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    vocab = gb.LLAMA_8B["vocab_size"]

    def forward(seed: int) -> float:
        ids = torch.tensor([_prompt(n, vocab, seed)], device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    res = _measure(forward)
    model = None  # (the closure above holds it: free it before the engine loads)
    _free()
    return res


def engine_side(n: int, **settings: Any) -> dict[str, Any]:  # noqa: ANN401
    from xlaserve import LLM, SamplingParams

    model_dir = gb.write_model_dir("/tmp/llama8b-prefill", 32)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=32768,
              gpu_memory_utilization=0.85, **settings)  # fmt: skip
    vocab = gb.LLAMA_8B["vocab_size"]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(seed: int) -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": _prompt(n, vocab, seed)}], sp, use_tqdm=False)
        return time.perf_counter() - t

    res = _measure(run)
    res["max_num_batched_tokens"] = llm.llm_engine.config.scheduler.max_num_batched_tokens
    res["settings"] = settings
    llm.llm_engine.shutdown()
    llm = None  # (the closure above holds it: free the engine before the next side)
    _free()
    return res


# Side -> engine settings (transformers: none).
SIDES: dict[str, dict[str, Any]] = {
    "transformers": {},
    "engine": {},
    "engine_sdpa": {"prefill_sdpa": "on"},
}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30000
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SIDES)
    res: dict[str, Any] = {"prompt_len": n, "device": torch.cuda.get_device_name()}
    for side in names:
        res[side] = hf_side(n) if side == "transformers" else engine_side(n, **SIDES[side])
        r = res[side]
        print(f"{side}: wall {r['wall_s']:.3f} s, gpu {r['gpu_ms']:.1f} ms, "
              f"{r['gpu_ms_by_kind']}", flush=True)  # fmt: skip
        for k in r["kernels"][:10]:
            print(f"   {k['ms']:8.2f} ms {k['calls']:5d} {k['kind']:9s} {k['name'][:90]}",
                  flush=True)  # fmt: skip
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "prefill_profile.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
