"""Resolve a model argument to a local HF-layout directory."""

from __future__ import annotations

import os


def is_orbax_dir(path: str) -> bool:
    """An `xlaserve convert --to orbax` output directory."""
    return os.path.exists(os.path.join(path, "xlaserve_orbax.json"))


def resolve_model_dir(
    model: str | None, revision: str | None = None, download_dir: str | None = None
) -> str:
    """None -> the demo model shipped in the package; an existing directory -> itself; otherwise a
    hub id, downloaded with huggingface_hub when the machine is online (clear error offline)."""
    if model is None:
        from xlaserve.demo import demo_model_path

        return demo_model_path()
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return os.path.abspath(path)
    if os.path.exists(path):
        raise ValueError(f"model {model!r} is a file; pass the model's directory (HF layout)")
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True") or os.environ.get(
        "XLASERVE_OFFLINE"
    ):
        raise FileNotFoundError(
            f"model {model!r} is not a local directory and the hub is offline (HF_HUB_OFFLINE); "
            "download it first and pass its directory"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise FileNotFoundError(
            f"model {model!r} is not a local directory; install huggingface_hub to download it"
        ) from e
    try:
        return snapshot_download(
            model,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"],
        )
    except Exception as e:  # noqa: BLE001 - any network/hub failure becomes one clear message
        raise FileNotFoundError(
            f"model {model!r} is not a local directory and could not be downloaded "
            f"(offline or unknown id): {type(e).__name__}: {e}"
        ) from e
