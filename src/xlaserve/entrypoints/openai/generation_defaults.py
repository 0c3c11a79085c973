"""`--generation-config auto|vllm|DIR`: sampling defaults from a `generation_config.json`, as vLLM.

- "auto": the model directory's generation_config.json (the model creator's recommendation).
- "vllm": none; a field the request leaves out takes xlaserve's (= vLLM's) neutral default
  (temperature 1.0, top_p 1.0, ...).
- DIR: the generation_config.json in that directory.

Only the sampling fields vLLM takes are read: temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens (the default `max_tokens` of chat requests). They fill a
request's fields that the client left unset; a value the client sends always wins.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger("xlaserve.server")

# generation_config.json key -> request field.
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(mode: str, model_dir: str | None) -> dict[str, Any]:
    """Request field -> default value (ValueError for a DIR without generation_config.json)."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        if not model_dir:
            return {}
        path = os.path.join(model_dir, "generation_config.json")
        if not os.path.exists(path):
            return {}
    else:
        path = os.path.join(mode, "generation_config.json")
        if not os.path.exists(path):
            raise ValueError(
                f"--generation-config {mode!r}: expected 'auto', 'vllm' or a directory holding "
                "generation_config.json"
            )
    with open(path) as f:
        cfg = json.load(f)
    out: dict[str, Any] = {}
    for key, field_name in GENERATION_KEYS.items():
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if key == "top_k" and v <= 0:
            continue  # HF's "no top-k"
        out[field_name] = v
    return out


def apply_generation_defaults(req: Any, defaults: dict[str, Any]) -> None:  # noqa: ANN401
    """Fill `req`'s unset (None) sampling fields from `defaults`, in place. `max_tokens` only
    for chat requests (no max_tokens nor max_completion_tokens given): completions default to
    16 tokens as OpenAI's API says."""
    for name, value in defaults.items():
        if name == "max_tokens":
            if hasattr(req, "max_completion_tokens"):
                if req.max_tokens is None and req.max_completion_tokens is None:
                    req.max_tokens = int(value)
            continue
        if getattr(req, name, 0) is None:
            setattr(req, name, int(value) if name == "top_k" else float(value))


def describe(mode: str, defaults: dict[str, Any]) -> str:
    """One start-up log line naming the defaults in force."""
    if not defaults:
        return f"generation config {mode!r}: no sampling defaults (neutral: temperature 1.0)"
    shown = ", ".join(f"{k}={v}" for k, v in sorted(defaults.items()))
    return f"generation config {mode!r}: defaults for fields a request leaves out: {shown}"
