"""bench/structured_bench.py runs end to end on the CPU (the --llama8b code path at the tiny
shape, async scheduling on as on the GPU) and writes every row of its JSON report."""

from __future__ import annotations

import json

from xlaserve.bench.structured_bench import NESTED_SCHEMA, main


def test_structured_bench_runs_every_row(tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "so.json"
    args = ["--llama8b", "--tiny", "--backend", "torch", "--async-scheduling", "on",
            "--batches", "3,1", "--input-len", "8", "--output-len", "4", "--repeats", "1",
            "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    rep = json.loads(out.read_text())
    rows = rep["rows"]
    for key in ("batch3", "batch1", "first32"):
        assert rows[key]["plain_tok_s"] > 0 and rows[key]["constrained_tok_s"] > 0, key
        assert rows[key]["output_tokens"]["plain"] > 0
    # Async scheduling stayed on with the grammar in every constrained run.
    assert rows["batch3"]["overlapped_steps"]["constrained"] > 0
    assert set(rows["compile"]) == {"issue_schema", "nested_2kb"}
    assert rows["compile"]["nested_2kb"]["schema_bytes"] == len(json.dumps(NESTED_SCHEMA)) >= 2048
    assert rows["fill"]["B=3 threads=1"] > 0
    assert rows["fill"]["B=3 python progress beside a fill thread"] > 0
    for interval in ("5 ms", "engine's"):
        assert rows["fill"][f"B=3 fill thread done after (switch interval {interval})"] > 0
        assert rows["fill"][f"B=3 engine waits for it (switch interval {interval})"] >= 0
    # Jump-forward off vs on (a second engine): identical greedy tokens, never more steps.
    for key in ("issue_schema batch3", "issue_schema batch1", "jump_schema batch3"):
        row = rows["jump"][key]
        assert row["same_tokens"], key
        assert 0 < row["steps_on"] <= row["steps_off"], key
        assert row["output_tokens"]["on"] == row["output_tokens"]["off"] > 0


def test_phases_time_the_engine_parts(tmp_path) -> None:  # noqa: ANN001
    """--phases: per mode, the median ms of each engine part; the grammar's parts only in the
    constrained runs; the methods are the classes' own again afterwards."""
    from xlaserve.bench.structured_bench import PhaseTimer

    out = tmp_path / "so.json"
    args = ["--llama8b", "--tiny", "--backend", "torch", "--async-scheduling", "on",
            "--batches", "3", "--input-len", "8", "--output-len", "4", "--repeats", "1",
            "--only-batches", "--phases", "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    ph = json.loads(out.read_text())["rows"]["batch3"]["phases_ms_median"]
    assert set(ph) == {"plain", "constrained"}
    for mode in ph.values():
        for part in ("step", "core.scheduler.schedule", "core.runner.launch", "core._process"):
            assert mode[part] >= 0, (part, mode)
    for part in ("core._structured.accept_step", "core._attach_bitmasks", "core._late_fill_job",
                 "core.runner.apply_bitmasks"):  # fmt: skip
        assert part in ph["constrained"], part
    assert "core._structured.accept_step" not in ph["plain"]
    row = json.loads(out.read_text())["rows"]["batch3"]
    for mode, tot in row["phases_ms_per_run"].items():
        # One run per mode: the parts add up inside the wall time, and every request was added.
        assert tot["wall"] >= tot["step"] + tot["add_request"] > 0, (mode, tot)
        assert tot["outside_steps"] == round(tot["wall"] - tot["step"] - tot["add_request"], 2)
        tail = row["step_tail_ms"][mode]
        assert tail["calls_per_run"] >= 4 and tail["max"] >= tail["p90"] > 0, (mode, tail)

    class _Eng:  # a stand-in owner: wrapped while active, its own method again after
        def step(self) -> int:
            return 7

    eng = _Eng()
    with PhaseTimer(eng) as t:
        assert eng.step() == 7 and "step" in eng.__dict__
    assert "step" not in eng.__dict__ and eng.step() == 7
    assert len(t.times["step"]) == 1 and set(t.medians_ms()) == {"step"}
    assert t.runs == 1 and set(t.totals_ms()) == {"step"}


def test_fill_thread_ab_in_one_engine(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """--fill-thread ab: every repeat runs plain, constrained with the fill thread off, then on,
    in the same engine; the fill thread gets work (a late fill a step) only while it is
    switched on."""
    import xlaserve.bench.structured_bench as sb
    import xlaserve.engine.core as core_mod

    state: dict[str, bool | None] = {"on": None}  # None: before the first switch (warm-up)
    switches: list[bool] = []
    submits: list[bool | None] = []

    class Pool(core_mod.ThreadPoolExecutor):
        def submit(self, fn, /, *a, **k):  # noqa: ANN001, ANN202
            submits.append(state["on"])
            return super().submit(fn, *a, **k)

    set_structured = sb._set_structured

    def switch(  # noqa: ANN202
        llm,  # noqa: ANN001
        fill_thread: bool | None = None,
        accept_threads: int | None = None,
    ):
        if fill_thread is not None:
            switches.append(fill_thread)
            state["on"] = fill_thread
        set_structured(llm, fill_thread, accept_threads)

    monkeypatch.setattr(core_mod, "ThreadPoolExecutor", Pool)
    monkeypatch.setattr(sb, "_set_structured", switch)
    out = tmp_path / "so.json"
    args = ["--llama8b", "--tiny", "--backend", "torch", "--async-scheduling", "on",
            "--batches", "3", "--input-len", "8", "--output-len", "6", "--repeats", "2",
            "--only-batches", "--fill-thread", "ab", "--phases", "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    row = json.loads(out.read_text())["rows"]["batch3"]
    assert (
        len(row["fill_thread"]["pair_ratios"]) == 2 and row["fill_thread"]["constrained_tok_s"] > 0
    )
    assert set(row["phases_ms_per_run"]) == {"plain", "constrained", "constrained_fill_thread"}
    assert switches == [False, True, False, True]
    timed = [on for on in submits if on is not None]
    # Work only with the thread on: 2 repeats x <= 6 steps, no more.
    assert timed and all(timed) and len(timed) <= 2 * 6, timed


def test_accept_ab_in_one_engine(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """--accept-ab N: every repeat runs plain, constrained with one accept thread, then with N,
    in the same engine; the step's batch accept is split only in the N runs (64 rows: two
    slices of 32)."""
    import xlaserve.structured.manager as manager_mod
    from xlaserve.structured.manager import StructuredOutputManager

    seen: list[tuple[int, int]] = []  # (threads set, rows) per batch accept
    inner = StructuredOutputManager.batch_accept

    def batch_accept(self, matchers, tokens):  # noqa: ANN001, ANN202
        seen.append((self.accept_threads, len(matchers)))
        return inner(self, matchers, tokens)

    monkeypatch.setattr(StructuredOutputManager, "batch_accept", batch_accept)
    # The engine's default: one accept thread whatever this host's cores.
    monkeypatch.setattr(manager_mod, "fill_threads", lambda configured, cpus: configured or 1)
    out = tmp_path / "so.json"
    args = ["--llama8b", "--tiny", "--backend", "torch", "--async-scheduling", "on",
            "--batches", "64", "--input-len", "4", "--output-len", "4", "--repeats", "1",
            "--only-batches", "--accept-ab", "2", "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    row = json.loads(out.read_text())["rows"]["batch64"]
    assert len(row["accept_threads"]["pair_ratios"]) == 1
    assert row["output_tokens"]["constrained_accept"] == row["output_tokens"]["constrained"] > 0
    full = [th for th, rows in seen if rows == 64]
    # The warm-up and the untimed round take the default (1); then the timed constrained run
    # 1 thread, the accept run 2, in that order.
    assert 2 in full and full[-1] == 2 and full.index(2) > 0 and full[full.index(2) - 1] == 1


def test_engine_process_batch_rows(tmp_path) -> None:  # noqa: ANN001
    """--engine-process: the batch rows with the engine core in its own process (the server's
    layout) generate every token of both modes; the in-process probes are refused with it."""
    import pytest

    out = tmp_path / "so.json"
    args = ["--llama8b", "--tiny", "--backend", "torch", "--batches", "3", "--input-len", "8",
            "--output-len", "4", "--repeats", "1", "--only-batches", "--engine-process",
            "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    rep = json.loads(out.read_text())
    row = rep["rows"]["batch3"]
    assert rep["args"]["engine_process"] is True
    assert row["output_tokens"] == {"plain": 12, "constrained": 12}
    assert row["constrained_tok_s"] > 0 and row["overlapped_steps"]["plain"] is None
    for extra in (["--phases"], ["--profile", "3"], ["--fill-thread", "ab"]):
        with pytest.raises(SystemExit):
            main([*args, *extra])
    with pytest.raises(SystemExit):
        main([a for a in args if a != "--only-batches"])
