"""The kernels_cuda package is lazy and reports where Triton can run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import xlaserve.kernels_cuda as kc


def _python(code: str, env_interpret: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if env_interpret is not None:
        env["TRITON_INTERPRET"] = env_interpret
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_import_is_lazy():
    out = _python(
        "import sys, xlaserve.kernels_cuda as k; "
        "print('torch' in sys.modules, 'triton' in sys.modules, sorted(k.__all__)[0])",
        None,
    )
    assert out == "False False causal_conv1d_prefill"


def test_triton_available_follows_interpret_flag():
    code = "import xlaserve.kernels_cuda as k; print(k.triton_available())"
    assert _python(code, "1") == "True"
    if not torch.cuda.is_available():
        assert _python(code, None) == "False"


def test_lazy_attributes_resolve_and_unknown_raises():
    from xlaserve.kernels_cuda.paged_attention import unified_attention

    assert kc.unified_attention is unified_attention
    assert callable(kc.silu_and_mul) and callable(kc.write_kv)
    with pytest.raises(AttributeError, match="no_such_kernel"):
        kc.no_such_kernel  # noqa: B018
