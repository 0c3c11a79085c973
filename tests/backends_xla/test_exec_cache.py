"""The XLA executable cache (backends_xla/exec_cache.py), each engine in a fresh process as a
restarted server would be: a warm start loads every start-up program without tracing and
generates the same tokens; a different configuration misses; a damaged entry is recompiled; the
switch off writes nothing (and None, the default, is off on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from xlaserve.backends_xla.exec_cache import SUBDIR, code_digest

RUN = """
import json, sys
from xlaserve import LLM, SamplingParams
cache_dir, kw = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(None, backend="xla", max_num_batched_tokens=64, compilation_cache_dir=cache_dir, **kw)
out = llm.generate(["In the beginning God", "And the earth was"],
                   SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
r = llm.llm_engine.runner
res = [[o.outputs[0].token_ids for o in out], r.exec_cache_loads, len(r.startup_programs())]
llm.llm_engine.shutdown()
print(json.dumps(res))
"""


def _run(
    cache_dir: str, env: dict[str, str] | None = None, **kw: object
) -> tuple[list[list[int]], int, int]:
    """(greedy tokens, programs loaded from the executable cache, start-up programs) of an
    engine built in a new process (`env`: added to its environment)."""
    kw = {"max_num_seqs": 4, "xla_executable_cache": True, **kw}
    done = subprocess.run(
        [sys.executable, "-c", RUN, cache_dir, json.dumps(kw)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    tokens, loads, n = json.loads(done.stdout.strip().splitlines()[-1])
    return tokens, loads, n


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


def test_warm_start_loads_every_program_and_matches(cold) -> None:  # noqa: ANN001
    d, tokens, _ = cold
    warm_tokens, loads, n = _run(d)
    assert loads == n
    assert warm_tokens == tokens


def test_other_configuration_misses(cold) -> None:  # noqa: ANN001
    d, tokens, _ = cold
    before = set(_entries(d))
    other_tokens, loads, n = _run(d, max_num_seqs=2)  # other request buckets, other programs
    assert loads == 0
    assert len(set(_entries(d)) - before) >= n
    assert other_tokens == tokens


def test_other_xla_flags_miss(cold) -> None:  # noqa: ANN001
    """XLA_FLAGS shape the compiled programs: other flags, other entries."""
    d, tokens, _ = cold
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}  # XLA:CPU's default
    other_tokens, loads, _ = _run(d, env=flags)
    assert loads == 0 and other_tokens == tokens


def test_damaged_entry_is_recompiled(cold) -> None:  # noqa: ANN001
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


@pytest.mark.parametrize("setting", [False, None])
def test_off_writes_nothing(setting: bool | None, tmp_path) -> None:  # noqa: ANN001
    if setting is None:  # the default is off on the CPU only
        jax = pytest.importorskip("jax")
        if jax.default_backend() != "cpu":
            pytest.skip("xla_executable_cache=None is on off the CPU")
    tokens, loads, _ = _run(str(tmp_path), xla_executable_cache=setting)
    assert loads == 0 and _entries(str(tmp_path)) == []
    assert len(tokens) == 2


def test_code_digest_is_stable() -> None:
    assert code_digest() == code_digest() and len(code_digest()) == 64
