"""State-space / hybrid model benchmark (issue 25): a Mamba2-2.7B-shaped and a Bamba-9B-shaped
dummy model, xlaserve beside transformers `generate` on the same shape, in one command.

Rows per shape (each in its own subprocess, so one failure or OOM leaves the others; the parent
merges their JSON into ``--output-json`` after each row):
- ``xlaserve-<backend>``: ``LLM(load_format="dummy")``: ``batch1`` (128 prompt tokens, 256 greedy
  output tokens, EOS ignored; decode rate = 255 / (t(256 tokens) - t(1 token)), median of
  ``--repeats``) against the memory roofline, and ``offline`` (``--num-prompts`` random prompts
  of ``--input-len`` tokens, ``--output-len`` output tokens each: output tokens / wall time);
- ``xlaserve-torch-eager`` (opt-in, ``--systems``): the torch row with ``enforce_eager=True``
  (decode CUDA graphs off), beside ``xlaserve-torch`` to measure what the graphs bring; torch
  rows record ``cuda_graph_replays`` (decode steps served by a graph);
- ``transformers``: the same model built from the same config (random bf16 weights) on the same
  device: batch-1 decode rate, and offline as ``generate`` over batches of ``--hf-batch`` equal-
  length prompts (``--hf-prompts`` of them; the rate is comparable per output token).

Memory roofline of batch-1 decode: every weight (bf16) is read once per token, plus each layer's
recurrent state (float32) read and written: ``roofline tok/s = bandwidth / bytes per token``
(``--bandwidth-gbs``, H200: 4800 GB/s).

Run on the GPU (the lead):
    python -m xlaserve.bench.ssm_bench --output-json ssm.json
Decode CUDA graphs against eager, side by side:
    python -m xlaserve.bench.ssm_bench --systems xlaserve-torch,xlaserve-torch-eager \
        --output-json ssm_graphs.json
CPU smoke test (tiny shapes):
    python -m xlaserve.bench.ssm_bench --tiny --num-prompts 4 --input-len 8 --output-len 8 \
        --hf-prompts 2 --batch1-output 8 --repeats 1 --in-process --output-json ssm.json
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

TOKENS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}

MAMBA2_2_7B: dict[str, Any] = {
    "architectures": ["Mamba2ForCausalLM"],
    "model_type": "mamba2",
    "hidden_size": 2560,
    "num_hidden_layers": 64,
    "num_heads": 80,
    "head_dim": 64,
    "state_size": 128,
    "n_groups": 1,
    "expand": 2,
    "conv_kernel": 4,
    "chunk_size": 256,
    "vocab_size": 50288,
    "tie_word_embeddings": True,
    "layer_norm_epsilon": 1e-5,
    "torch_dtype": "bfloat16",
    **TOKENS,
}

BAMBA_9B: dict[str, Any] = {
    "architectures": ["BambaForCausalLM"],
    "model_type": "bamba",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "attn_layer_indices": [9, 18, 27],
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "vocab_size": 128256,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    **TOKENS,
}

# CPU smoke shapes: same architectures, tiny dims.
TINY = {
    "mamba2": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16,
               "state_size": 16, "vocab_size": 512, "chunk_size": 8},
    "bamba": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "attn_layer_indices": [1, 3], "num_attention_heads": 4, "num_key_value_heads": 2,
              "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "vocab_size": 512,
              "mamba_chunk_size": 8},
}  # fmt: skip
SHAPES = {"mamba2": MAMBA2_2_7B, "bamba": BAMBA_9B}

# Issue 25 part B (not in the default --shapes): LFM2-1.2B-, Nemotron-H-8B- and
# Falcon-H1-1.5B-shaped dummies (`--shapes lfm2,nemotron_h,falcon_h1`).
_NEMOTRON_PATTERN = ("M-M-M-M*-" + "M-M-M-M-M*-" * 3 + "M-M-M-M-M-M-")[:52]
SHAPES.update(
    lfm2={
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 2048,
        "intermediate_size": 12288, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "conv_L_cache": 3,
        "vocab_size": 65536, "max_position_embeddings": 128000, "norm_eps": 1e-5,
        "rope_theta": 1e6, "tie_word_embeddings": True, "torch_dtype": "bfloat16", **TOKENS,
    },
    nemotron_h={
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4096,
        "hybrid_override_pattern": _NEMOTRON_PATTERN, "num_hidden_layers": 52,
        "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128,
        "n_groups": 8, "conv_kernel": 4, "chunk_size": 128, "vocab_size": 131072,
        "max_position_embeddings": 8192, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", **TOKENS,
    },
    falcon_h1={
        "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "mamba_d_ssm": 3072, "mamba_n_heads": 24,
        "mamba_d_head": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4,
        "mamba_chunk_size": 256, "vocab_size": 65536, "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16", **TOKENS,
    },
)  # fmt: skip
TINY.update(
    lfm2={"hidden_size": 64, "intermediate_size": 192, "block_multiple_of": 32,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "full_attn_idxs": [1, 3], "vocab_size": 512},
    nemotron_h={"hidden_size": 64, "hybrid_override_pattern": "M*-M-", "num_hidden_layers": 5,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 16,
                "ssm_state_size": 16, "n_groups": 2, "chunk_size": 8, "vocab_size": 512},
    falcon_h1={"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2,
               "mamba_d_state": 16, "mamba_chunk_size": 8, "vocab_size": 512},
)  # fmt: skip

# Qwen3-Next (issue 25 part A; opt-in: --shapes qwen3_next): the layer shape of
# Qwen3-Next-80B-A3B, 12 of its 48 layers (3 gated attention + 9 Gated DeltaNet; ~20B parameters,
# so xlaserve or transformers fits one H200 in bf16). Its roofline counts every expert's weights
# (an upper bound on the bytes a batch-1 token reads: only 10 of 512 experts are active).
QWEN3_NEXT_80B_12L: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000.0,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    **TOKENS,
}
SHAPES["qwen3_next"] = QWEN3_NEXT_80B_12L
TINY["qwen3_next"] = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "full_attention_interval": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "vocab_size": 512,
}  # fmt: skip


def write_model(name: str, root: str, tiny: bool) -> str:
    """A config.json (+ the tiny BPE tokenizer of the demo's corpus) under root/name."""
    cfg = dict(SHAPES[name])
    if tiny:
        cfg.update(TINY[name], torch_dtype="float32")
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(ord("a") + i): i for i in range(26)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "b"}, f)
    return path


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def roofline(path: str, bandwidth_gbs: float) -> dict[str, float]:
    """Bytes per batch-1 decode token (bf16 weights + float32 state read and written)."""
    import torch
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    from xlaserve.model_loader.registry import build_spec
    from xlaserve.model_loader.ssm import cache_layout

    spec = build_spec(path)
    state = cache_layout(spec, 2, 16).bytes_per_slot
    per_token = 2 * params + 2 * state
    return {
        "params": params,
        "state_bytes_per_seq": state,
        "bytes_per_token": per_token,
        "roofline_tokens_per_s": bandwidth_gbs * 1e9 / per_token,
    }


def run_xlaserve(
    path: str, backend: str, a: argparse.Namespace, enforce_eager: bool = False
) -> dict[str, Any]:
    from xlaserve import LLM, SamplingParams

    dev_cpu = not _cuda()
    llm = LLM(
        path, backend=backend, load_format="dummy", dtype="float32" if dev_cpu else "bfloat16",
        max_model_len=a.input_len + a.output_len + 256, enforce_eager=enforce_eager,
    )  # fmt: skip
    vocab = llm.llm_engine.core.spec.vocab_size
    one = _prompts(1, 128 if not a.tiny else 8, vocab, seed=1)

    def gen(prompts: list[list[int]], n: int) -> float:
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": x} for x in prompts], p, use_tqdm=False)
        return time.perf_counter() - t0

    t_ready = time.perf_counter()
    gen(one, 4)  # warm-up (compiles, Triton caches)
    rates = []
    for _ in range(a.repeats):
        t1, tn = gen(one, 1), gen(one, a.batch1_output)
        rates.append((a.batch1_output - 1) / max(tn - t1, 1e-9))
    # Progress on stderr: a row cut by --timeout-s still reports how far it got.
    print(f"batch1 decode {statistics.median(rates):.1f} tok/s "
          f"({time.perf_counter() - t_ready:.1f} s after start-up)", file=sys.stderr, flush=True)  # fmt: skip
    prompts = _prompts(a.num_prompts, a.input_len, vocab)
    gen(prompts[: min(8, len(prompts))], 2)
    wall = gen(prompts, a.output_len)
    row = {
        "batch1_decode_tokens_per_s": statistics.median(rates),
        "offline_output_tokens_per_s": a.num_prompts * a.output_len / wall,
        "offline_wall_s": wall,
    }
    step = getattr(llm.llm_engine.core.runner, "cuda_step", None)
    if backend == "torch":
        row["cuda_graph_replays"] = step.num_replays if step is not None else 0
    return row


def run_transformers(path: str, a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers as tf

    dev = "cuda" if _cuda() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = tf.AutoConfig.from_pretrained(path)
    with torch.device(dev):  # random init on the device: minutes on the host at 2.7B / 9B
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    vocab = cfg.vocab_size

    def gen(prompts: list[list[int]], n: int) -> float:
        ids = torch.tensor(prompts, device=dev)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    one = _prompts(1, 128 if not a.tiny else 8, vocab, seed=1)
    gen(one, 4)
    rates = []
    n1 = a.hf_batch1_output or a.batch1_output
    for _ in range(a.repeats):
        t1, tn = gen(one, 1), gen(one, n1)
        rates.append((n1 - 1) / max(tn - t1, 1e-9))
        print(f"batch1 decode {rates[-1]:.1f} tok/s", file=sys.stderr, flush=True)
    prompts = _prompts(a.hf_prompts, a.input_len, vocab)
    wall = 0.0
    for i in range(0, len(prompts), a.hf_batch):
        wall += gen(prompts[i : i + a.hf_batch], a.output_len)
        done = min(i + a.hf_batch, len(prompts))
        print(f"offline {done} prompts: {done * a.output_len / wall:.1f} tok/s",
              file=sys.stderr, flush=True)  # fmt: skip
    return {
        "batch1_decode_tokens_per_s": statistics.median(rates),
        "batch1_output_tokens": n1,
        "offline_output_tokens_per_s": len(prompts) * a.output_len / wall,
        "offline_prompts": len(prompts),
        "offline_batch": a.hf_batch,
    }


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_row(shape: str, system: str, path: str, a: argparse.Namespace) -> dict[str, Any]:
    if system == "transformers":
        return run_transformers(path, a)
    if system == "xlaserve-torch-eager":
        return run_xlaserve(path, "torch", a, enforce_eager=True)
    return run_xlaserve(path, system.removeprefix("xlaserve-"), a)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="mamba2,bamba")
    p.add_argument("--systems", default="xlaserve-torch,xlaserve-xla,transformers")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batch1-output", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-prompts", type=int, default=256)
    # transformers without mamba_ssm runs a torch chunk scan whose memory grows with the batch:
    # 64 prompts of 256 tokens asked for 160 GiB (Mamba2-2.7B) / 256 GiB (Bamba-9B) on the H200.
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--hf-batch1-output", type=int, default=0,
                   help="transformers' batch-1 output tokens (0: --batch1-output)")  # fmt: skip
    p.add_argument("--bandwidth-gbs", type=float, default=4800.0)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--in-process", action="store_true", help="rows in this process (tests)")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--output-json", default="ssm_bench.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "shape:system:path"
    return p.parse_args(argv)


class RowFailed(RuntimeError):
    """A worker that failed or ran past its time; stderr_tail keeps its progress lines."""

    def __init__(self, msg: str, stderr_tail: str) -> None:
        super().__init__(msg)
        self.stderr_tail = stderr_tail


def _run_worker(cmd: list[str], timeout_s: float) -> dict[str, Any]:
    """One row in a child process; its stderr goes to a file so a timed-out row still reports
    how far it got (subprocess.run drops a killed child's pipes on POSIX)."""
    with tempfile.TemporaryFile("w+") as err, tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        err.seek(0)
        out.seek(0)
        tail, stdout = err.read()[-2000:], out.read()
    if rc is None:
        raise RowFailed(f"timed out after {timeout_s:.0f} s", tail)
    if rc != 0:
        raise RowFailed(f"exit status {rc}: {tail[-1000:]}", tail)
    return json.loads(stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = _args(argv)
    if a.worker:  # child: one row, JSON on stdout's last line
        shape, system, path = a.worker.split(":", 2)
        print(json.dumps(run_row(shape, system, path, a)))
        return {}
    results: dict[str, Any] = {"config": {k: v for k, v in vars(a).items() if k != "worker"}}
    root = tempfile.mkdtemp(prefix="ssm-bench-")
    for shape in a.shapes.split(","):
        path = write_model(shape, root, a.tiny)
        entry: dict[str, Any] = {"roofline": roofline(path, a.bandwidth_gbs)}
        results[shape] = entry
        for system in a.systems.split(","):
            try:
                if a.in_process:
                    row = run_row(shape, system, path, a)
                else:
                    cmd = [sys.executable, "-m", "xlaserve.bench.ssm_bench", *(argv or sys.argv[1:]),
                           "--worker", f"{shape}:{system}:{path}"]  # fmt: skip
                    row = _run_worker(cmd, a.timeout_s)
                dec = row["batch1_decode_tokens_per_s"]
                row["batch1_ratio_to_roofline"] = dec / entry["roofline"]["roofline_tokens_per_s"]
            except Exception as e:  # noqa: BLE001 - a failed row is recorded, the others run
                err = getattr(e, "stderr_tail", "")  # a timed-out row's progress so far
                row = {"error": f"{type(e).__name__}: {e}"[-2000:], "stderr_tail": err[-1500:]}
            entry[system] = row
            with open(a.output_json, "w") as f:
                json.dump(results, f, indent=2)
            print(shape, system, json.dumps(row), flush=True)
    return results


if __name__ == "__main__":
    main()
