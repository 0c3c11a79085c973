"""Helpers for the quantization tests: full-sequence logits through the torch runner, and
pre-quantized HF checkpoints (GPTQ / AWQ / compressed-tensors fp8) written from a float one."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np

LINEAR_RE = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def prefill_metadata(n: int, block_size: int) -> tuple[object, int]:
    """Torch AttentionMetadata of one sequence prefilled from position 0 over blocks 0, 1, ...
    (n tokens), and the number of blocks it spans."""
    import torch

    from xlaserve.backends_torch.layers.attention import AttentionMetadata

    nblk = -(-n // block_size)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(nblk, dtype=torch.int32)[None, :],
        slot_mapping=torch.arange(n),
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_host=[0, n],
        seq_lens_host=[n],
    )
    return md, nblk


def torch_runner(model_dir: str, **kwargs: object):  # noqa: ANN201
    """A TorchModelRunner (model loaded) built with EngineConfig.from_kwargs(model=model_dir,
    **kwargs)."""
    from xlaserve.backends_torch.runner import TorchModelRunner
    from xlaserve.config import EngineConfig
    from xlaserve.model_loader.registry import build_spec

    cfg = EngineConfig.from_kwargs(model=model_dir, backend="torch", **kwargs)
    runner = TorchModelRunner(cfg, build_spec(model_dir))
    runner.load_model()
    return runner


def torch_prefill_logits(runner, token_ids: list[int]) -> np.ndarray:  # noqa: ANN001
    """Logits [T, V] float32 of every position of `token_ids` (one prefill) on `runner`."""
    import torch

    n = len(token_ids)
    md, nblk = prefill_metadata(n, runner.block_size)
    caches = runner._alloc_caches(nblk)
    ids = torch.tensor(token_ids, dtype=torch.long)
    hidden = runner.model(ids, torch.arange(n), caches, md)
    return runner.model.compute_logits(hidden).float().numpy()


def runner_logits(model_dir: str, token_ids: list[int], **kwargs: object) -> np.ndarray:
    """Logits [T, V] float32 of every position of `token_ids` (one prefill) on the torch runner
    built with EngineConfig.from_kwargs(model=model_dir, **kwargs)."""
    return torch_prefill_logits(torch_runner(model_dir, **kwargs), token_ids)


def perplexity(logits: np.ndarray, token_ids: list[int]) -> float:
    """exp(mean NLL of token t+1 given the prefix), logits [T, V]."""
    x = logits[:-1].astype(np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    nll = lse - x[np.arange(len(x)), token_ids[1:]]
    return float(np.exp(nll.mean()))


def _read(model_dir: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def _save(tensors: dict[str, np.ndarray], path: str) -> None:
    import torch
    from safetensors.torch import save_file

    from xlaserve.quantization import FP8_E4M3

    out = {}
    for k, v in tensors.items():
        if v.dtype == FP8_E4M3:
            out[k] = torch.from_numpy(np.ascontiguousarray(v).view(np.uint8)).view(
                torch.float8_e4m3fn
            )
        else:
            out[k] = torch.from_numpy(np.ascontiguousarray(v))
    save_file(out, path, metadata={"format": "pt"})


def write_prequantized(src: str, dst: str, fmt: str, group_size: int = 32, **opts: object) -> str:
    """Copy the float HF checkpoint `src` to `dst` with every decoder linear quantized in `fmt`
    ("gptq", "awq", "compressed-tensors" fp8, "compressed-tensors-int8" W8A8 (opts: strategy,
    w8a16=True for weight-only), "fp8-block" DeepSeek / Qwen3-FP8 style (opts: block)), and
    config.json's quantization_config set the way the reference tools write it. Returns dst."""
    from xlaserve.quantization.hf_formats import (
        pack_awq,
        pack_gptq,
        quantize_compressed_fp8,
        quantize_compressed_int8,
        quantize_fp8_block,
    )

    block = tuple(opts.get("block", (128, 128)))

    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    rng = np.random.default_rng(0)
    out: dict[str, np.ndarray] = {}
    for name, w in _read(src).items():
        if not LINEAR_RE.match(name):
            out[name] = w
            continue
        prefix = name[: -len(".weight")]
        if fmt == "gptq":
            perm = rng.permutation(w.shape[1]) if opts.get("desc_act") else None
            parts = pack_gptq(w, group_size, sym=True, perm=perm, v1=True)
        elif fmt == "awq":
            parts = pack_awq(w, group_size)
        elif fmt == "compressed-tensors-int8":
            parts = quantize_compressed_int8(w, str(opts.get("strategy", "channel")))
            if not opts.get("w8a16"):
                parts["input_scale"] = np.ones((1,), np.float32)  # a static scale: dropped
        elif fmt == "fp8-block":
            parts = quantize_fp8_block(w, block)
        else:
            parts = quantize_compressed_fp8(w, str(opts.get("strategy", "channel")))
        for k, v in parts.items():
            out[f"{prefix}.{k}"] = v
    _save(out, os.path.join(dst, "model.safetensors"))
    if fmt == "gptq":
        qc = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": bool(opts.get("desc_act", False)),
            "sym": True,
            "checkpoint_format": "gptq",
        }
    elif fmt == "awq":
        qc = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    elif fmt == "fp8-block":
        qc = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block),
            "modules_to_not_convert": ["lm_head"],
        }
    elif fmt == "compressed-tensors-int8":
        strategy = str(opts.get("strategy", "channel"))
        act = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
               "dynamic": True}  # fmt: skip
        qc = {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "int",
                        "strategy": strategy,
                        "symmetric": True,
                        "dynamic": False,
                    },  # fmt: skip
                    "input_activations": None if opts.get("w8a16") else act,
                }
            },
            "ignore": ["lm_head"],
        }
    else:
        strategy = str(opts.get("strategy", "channel"))
        qc = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": strategy,
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "symmetric": True,
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head"],
        }
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst
