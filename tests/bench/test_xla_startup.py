"""bench/xla_startup.py on the demo model: a cold start compiles, a warm one (a new process with
the cache the cold one filled) takes every program from the persistent cache."""

from __future__ import annotations

import json

from xlaserve.bench import xla_startup


def test_cold_then_warm_start_up(tmp_path) -> None:
    out = tmp_path / "startup.json"
    res = xla_startup.main(
        [
            "--tokens",
            "64",
            "--seqs",
            "4",
            "--timeout",
            "240",
            "--executable-cache",
            "on",
            "--output-json",
            str(out),
        ]  # fmt: skip
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    cold, warm = res["cold"], res["warm"]
    assert "error" not in cold and "error" not in warm, (cold, warm)
    assert cold["xla_compiles"] > 0 and cold["persistent_cache_hits"] == 0
    # Warm: every program comes from xlaserve's executable cache (no trace, no compile event)
    # or, failing that, JAX's persistent cache; nothing is compiled.
    assert warm["xla_compiles"] == 0
    assert warm["executable_cache_loads"] > 0
    assert warm["executable_cache_loads"] + warm["persistent_cache_hits"] >= cold["programs"] - 1
    # Every program a request needs was compiled at start-up.
    assert cold["compiles_during_first_request"] == 0
    assert warm["compiles_during_first_request"] == 0
    assert cold["token_buckets"][-1] == 64 and cold["seq_buckets"][-1] == 4
