"""bench/gpu_probes/step_gaps.py: the timeline analysis on hand-made events, and a CPU smoke
run of the whole probe (tiny model; no device timeline there)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from xlaserve.bench.gpu_probes import step_gaps


@dataclass
class _Range:
    start: float
    end: float


@dataclass
class _Ev:
    name: str
    start: float
    end: float
    device_type: str = "DeviceType.CPU"

    @property
    def time_range(self) -> _Range:
        return _Range(self.start, self.end)


def test_analyse_splits_idle_by_the_part_the_host_was_in() -> None:
    """One 10 ms step (us): the device busy 0-3 and 5-9 ms (two overlapping kernels in the
    second stretch); the host in `launch` 2-6 ms and in `finish` 6-10 ms. Idle: 3-5 ms (gap
    starts inside launch) and 9-10 ms (inside finish)."""
    cuda = "DeviceType.CUDA"
    events = [
        _Ev(step_gaps.STEP, 0, 10_000),
        _Ev("launch", 2_000, 6_000),
        _Ev("finish", 6_000, 10_000),
        _Ev("k1", 0, 3_000, cuda),
        _Ev("k2", 5_000, 8_000, cuda),
        _Ev("k3", 7_000, 9_000, cuda),
    ]
    res = step_gaps.analyse(events)
    assert res["steps"] == 1 and res["wall_ms"] == 10.0
    assert res["gpu_busy_ms"] == 7.0 and res["gpu_idle_ms"] == 3.0
    assert res["gpu_idle_by_part_ms"] == {"launch": 2.0, "finish": 1.0}
    assert res["host_part_ms"] == {"launch": 4.0, "finish": 4.0}


def test_cpu_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "gaps.json"
    args = ["--tiny", "--batch", "4", "--steps", "3", "--warmup", "2", "--num-layers", "1",
            "--prompt-len", "8", "--out", str(out)]  # fmt: skip
    assert step_gaps.main(args) == 0
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["steps"] == 3 and res["gpu_busy_ms"] == 0.0
    assert res["wall_ms"] > 0 and res["host_part_ms"]["schedule"] > 0
