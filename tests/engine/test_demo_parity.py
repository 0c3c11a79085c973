"""The shipped demo model (and its draft): the engine's greedy tokens equal transformers'."""

from __future__ import annotations

import os

import pytest
from tiny_models import hf_greedy

from xlaserve import LLM, SamplingParams
from xlaserve.demo import demo_draft_model_path, demo_model_path

BACKENDS = [os.environ.get("XLASERVE_TEST_BACKEND", "torch")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["main", "draft"])
def test_demo_models_match_transformers(which: str, backend: str) -> None:
    path = demo_model_path() if which == "main" else demo_draft_model_path()
    llm = LLM(path, backend=backend, num_kv_blocks=256)
    tok = llm.get_tokenizer()
    prompts = [
        tok.encode(p)
        for p in ["And God said", "In the beginning", "The LORD is my shepherd; I shall"]
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    assert got == hf_greedy(path, prompts, 16)


def test_default_model_is_the_demo_and_writes_english() -> None:
    llm = LLM(num_kv_blocks=128)
    assert llm.llm_engine.model_dir == demo_model_path()
    text = (
        llm.generate("And God said", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[
            0
        ]
        .outputs[0]
        .text
    )
    words = [w.strip(",.;:") for w in text.split()]
    assert sum(w.isalpha() for w in words) >= 8
    assert {"unto", "the", "and", "him", "LORD", "God"} & set(words)
