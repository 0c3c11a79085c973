"""The periodic stats line (xlaserve/stats_logger.py) over a real engine behind the server."""

from __future__ import annotations

import logging
import re

import pytest
from ep_helpers import MODEL_NAME, wait_until

from xlaserve.stats_logger import StatsLogger

LINE = re.compile(
    r"Avg prompt throughput: (?P<p>[\d.]+) tokens/s, Avg generation throughput: (?P<g>[\d.]+) "
    r"tokens/s, Running: (?P<r>\d+) reqs, Waiting: (?P<w>\d+) reqs, KV cache usage: "
    r"(?P<kv>[\d.]+)%, Prefix cache hit rate: (?P<hit>[\d.]+)%"
)


def test_stats_line_reports_the_interval(server, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    import openai

    stats = StatsLogger(lambda: server.engine.stats)
    assert stats.line(now=100.0) is None  # the first reading is the baseline
    assert stats.line(now=101.0) is None  # idle: nothing to say
    before = server.engine.stats
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    r = c.completions.create(model=MODEL_NAME, prompt="a b c d", max_tokens=5, temperature=0)
    # The stats snapshot is taken after the step's outputs went out: it may trail the response.
    assert wait_until(
        lambda: server.engine.stats.generation_tokens_total - before.generation_tokens_total >= 5
    )
    after = server.engine.stats
    d_prompt = after.prompt_tokens_total - before.prompt_tokens_total
    d_gen = after.generation_tokens_total - before.generation_tokens_total
    assert d_gen == r.usage.completion_tokens == 5
    with caplog.at_level(logging.INFO, logger="xlaserve.stats"):
        text = stats.log(now=103.0)  # 2 s after the last reading
    assert text is not None and text in caplog.text
    m = LINE.fullmatch(text)
    assert m is not None, text
    assert float(m["p"]) == pytest.approx(d_prompt / 2.0, abs=0.05)
    assert float(m["g"]) == pytest.approx(d_gen / 2.0, abs=0.05)
    assert (int(m["r"]), int(m["w"])) == (0, 0)
    assert stats.line(now=104.0) is None  # idle again
