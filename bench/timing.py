"""Kernel timing for the benchmarks and GPU probes: one implementation of "median time per call".

Why graphs: a kernel of a few microseconds timed between two CUDA events around one eager call
measures the host's launch (Triton's Python launcher alone takes tens of microseconds), not the
kernel: the long-context decode rows read 166-177 us that way for a kernel the CUDA-graph sweep
timed at 45-68 us on the same H200 (bench/RESULTS.md, fifteenth session). The engine's decode
steps replay CUDA graphs, so that is how kernels are timed here.

- `graph_time_us(calls, reps)`: the calls run back to back, captured into ONE CUDA graph whose
  replays are timed with events; the result is per call. Callers pass several calls to rotate
  over weight copies (so a weight that fits the L2 is still read from HBM) or to average the
  replay's own overhead over more work. A call that cannot be captured (a host sync inside)
  is timed eagerly, back to back between two events. On the CPU: wall time of the calls.
- `event_time_us(fn, reps)`: one eager call between two events (fine for millisecond kernels;
  what a host-side caller pays otherwise); wall time on the CPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _replay_us(run: Callable[[], Any], reps: int, per: int) -> float:
    """Median microseconds of run() / per, each run between two CUDA events."""
    import torch

    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per)
    return statistics.median(times)


def graph_time_us(calls: Sequence[Callable[[], Any]], reps: int, cuda: bool | None = None) -> float:
    """Median microseconds per call of `calls` run back to back (see the module docstring).
    Every call runs once before the timing (compiles, warms caches). cuda: whether the calls
    run on the GPU (default: whether torch sees one; False times CPU work on a GPU host)."""
    if not calls:
        raise ValueError("graph_time_us: no calls")
    for call in calls:
        call()
    if not (_cuda() if cuda is None else cuda):
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for call in calls:
                call()
            times.append((time.perf_counter() - t) * 1e6 / len(calls))
        return statistics.median(times)
    import torch

    def eager() -> None:
        for call in calls:
            call()

    torch.cuda.synchronize()
    run: Callable[[], Any] = eager
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            calls[0]()  # warm on a side stream, as capture wants
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        run = graph.replay
    except Exception:  # noqa: BLE001 - not capturable (a host sync inside): eager calls
        torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    return _replay_us(run, reps, len(calls))


def event_time_us(
    fn: Callable[[], Any], reps: int, warmup: int = 1, cuda: bool | None = None
) -> float:
    """Median microseconds of one eager fn() call (CUDA events; wall time on the CPU). cuda: as
    in `graph_time_us`."""
    for _ in range(warmup):
        fn()
    if not (_cuda() if cuda is None else cuda):
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        return statistics.median(times)
    import torch

    torch.cuda.synchronize()
    return _replay_us(fn, reps, 1)
