"""Fixtures for structured-output tests: engines over the tiny random Llama, per backend."""

from __future__ import annotations

import pytest
from optional_deps import backend_available

# XLA cases whenever jax is installed; a jax install whose runner fails to import fails here
# (collection error), it does not silently drop the XLA cases.
BACKENDS = ["torch"] + (["xla"] if backend_available("xla") else [])


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request: pytest.FixtureRequest, tiny_model_dir):  # noqa: ANN201 - an xlaserve.LLM
    from xlaserve import LLM

    engine = LLM(
        tiny_model_dir("llama"),
        backend=request.param,
        dtype="float32",
        block_size=4,
        num_kv_blocks=256,
        max_model_len=256,
        # Few shape buckets: the XLA backend compiles each one at start.
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    yield engine
    engine.llm_engine.shutdown()
