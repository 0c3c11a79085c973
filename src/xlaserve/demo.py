"""Paths of the demo models shipped inside the package (HF layout, package data).

``demo-kjv`` (~1.9M parameters, Llama architecture, ChatML chat template) is what ``xlaserve
serve`` and ``LLM()`` load when no model is given; ``demo-kjv-draft`` (~0.2M parameters, same
tokenizer) is its draft model for speculative decoding. Both were trained on the King James Bible
by ``tools/train_demo.py``; see each directory's README.md.
"""

from __future__ import annotations

import os

ASSETS_DIR: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEMO_MODEL_NAME: str = "demo-kjv"
DEMO_DRAFT_NAME: str = "demo-kjv-draft"
DEMO_MODEL_DIR: str = os.path.join(ASSETS_DIR, DEMO_MODEL_NAME)
DEMO_DRAFT_DIR: str = os.path.join(ASSETS_DIR, DEMO_DRAFT_NAME)


def _checked(path: str) -> str:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"demo model files missing at {path}: the package was installed without its "
            "assets (package data), or tools/train_demo.py has not been run"
        )
    return path


def demo_model_path() -> str:
    """Directory of the demo model (config.json, model.safetensors, tokenizer files)."""
    return _checked(DEMO_MODEL_DIR)


def demo_draft_model_path() -> str:
    """Directory of the demo model's draft model for speculative decoding."""
    return _checked(DEMO_DRAFT_DIR)
