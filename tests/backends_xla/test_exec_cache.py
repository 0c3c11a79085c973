"""The XLA executable cache (backends_xla/exec_cache.py): a warm start loads every start-up
program without tracing and generates the same tokens; a different configuration misses; a
damaged entry is recompiled; the switch turns it off."""

from __future__ import annotations

import os

import pytest

from xlaserve import LLM, SamplingParams
from xlaserve.backends_xla.exec_cache import SUBDIR, code_digest

SMALL = {"backend": "xla", "max_num_batched_tokens": 64, "max_num_seqs": 4}
PROMPTS = ["In the beginning God", "And the earth was"]


def _run(cache_dir: str, **kw: object) -> tuple[list[list[int]], int, int]:
    """(greedy tokens of PROMPTS, programs loaded from the cache, start-up programs)."""
    llm = LLM(None, compilation_cache_dir=cache_dir, **{**SMALL, **kw})
    try:
        out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        r = llm.llm_engine.runner
        return [o.outputs[0].token_ids for o in out], r.exec_cache_loads, len(r.startup_programs())
    finally:
        llm.llm_engine.shutdown()


def _entries(cache_dir: str) -> list[str]:
    root = os.path.join(cache_dir, SUBDIR)
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]], list[str]]:
    d = str(tmp_path_factory.mktemp("jax-cache"))
    tokens, loads, n = _run(d)
    assert loads == 0
    # Every start-up program (and the memory-analysis forward on a GPU) was stored.
    assert len(_entries(d)) >= n
    return d, tokens, _entries(d)


def test_warm_start_loads_every_program_and_matches(
    cold: tuple[str, list[list[int]], list[str]],
) -> None:
    d, tokens, _ = cold
    warm_tokens, loads, n = _run(d)
    assert loads == n
    assert warm_tokens == tokens


def test_other_configuration_misses(cold: tuple[str, list[list[int]], list[str]]) -> None:
    d, tokens, _ = cold
    before = set(_entries(d))
    other_tokens, loads, n = _run(d, max_num_seqs=2)  # other request buckets, other programs
    assert loads == 0
    assert len(set(_entries(d)) - before) >= n
    assert other_tokens == tokens


def test_damaged_entry_is_recompiled(cold: tuple[str, list[list[int]], list[str]]) -> None:
    d, tokens, cold_entries = cold
    victim = os.path.join(d, SUBDIR, cold_entries[0])
    with open(victim, "wb") as f:
        f.write(b"not a pickle")
    again, loads, n = _run(d)
    assert again == tokens
    # Only the damaged one was recompiled (n on a GPU when the victim was the memory-analysis
    # forward, which is not a start-up program), and it was rewritten.
    assert loads in (n - 1, n)
    with open(victim, "rb") as f:
        assert f.read() != b"not a pickle"


def test_switch_off_writes_nothing(tmp_path) -> None:
    tokens, loads, _ = _run(str(tmp_path), xla_executable_cache=False)
    assert loads == 0 and _entries(str(tmp_path)) == []
    assert len(tokens) == len(PROMPTS)


def test_code_digest_is_stable() -> None:
    assert code_digest() == code_digest() and len(code_digest()) == 64
