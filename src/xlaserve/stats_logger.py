"""The periodic stats line of the server (vLLM's "Avg prompt throughput ..." line).

Every `interval` seconds while there is work (requests running or waiting, or tokens processed
since the last line) one INFO line on the `xlaserve.stats` logger:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

Throughputs are over the interval; the prefix-cache hit rate is over the interval's lookups
(the cumulative rate once the interval had none). Idle intervals log nothing. `serve
--disable-log-stats` turns it off; `--log-stats-interval` sets the period.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("xlaserve.stats")


@dataclass
class _Snapshot:
    """The cumulative counters of one EngineStats reading and when it was taken (seconds)."""

    t: float
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int


class StatsLogger:
    """Formats and logs the periodic stats line from successive `EngineStats` readings."""

    def __init__(self, get_stats: Callable[[], Any | None]) -> None:
        self._get_stats = get_stats
        self._last: _Snapshot | None = None

    @staticmethod
    def _snap(stats: Any, now: float) -> _Snapshot:  # noqa: ANN401 - EngineStats (any backend)
        return _Snapshot(
            now,
            stats.prompt_tokens_total,
            stats.generation_tokens_total,
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
        )

    def line(self, now: float) -> str | None:
        """The line for the interval ending at `now`, or None (idle, no stats yet, first call)."""
        stats = self._get_stats()
        if stats is None:
            return None
        cur = self._snap(stats, now)
        prev, self._last = self._last, cur
        if prev is None:
            return None
        dt = max(cur.t - prev.t, 1e-9)
        d_prompt = cur.prompt_tokens - prev.prompt_tokens
        d_gen = cur.generation_tokens - prev.generation_tokens
        if not (d_prompt or d_gen or stats.num_running or stats.num_waiting):
            return None
        d_q = cur.prefix_queries - prev.prefix_queries
        d_h = cur.prefix_hits - prev.prefix_hits
        if d_q > 0:
            hit = d_h / d_q
        else:
            hit = cur.prefix_hits / cur.prefix_queries if cur.prefix_queries else 0.0
        return (
            f"Avg prompt throughput: {d_prompt / dt:.1f} tokens/s, "
            f"Avg generation throughput: {d_gen / dt:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100.0 * hit:.1f}%"
        )

    def log(self, now: float) -> str | None:
        """Log the interval's line (if any) and return it."""
        text = self.line(now)
        if text is not None:
            logger.info("%s", text)
        return text
