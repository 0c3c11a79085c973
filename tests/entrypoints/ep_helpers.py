"""Helpers shared by the entrypoint tests (plain module: test files import it by name)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from xlaserve.config import EngineConfig, ServerConfig
from xlaserve.engine.async_llm import AsyncLLM
from xlaserve.entrypoints.openai.api_server import RUNNER_KWARGS, build_app

MODEL_NAME = "tiny"
API_KEY = "sk-test-key"
SMALL_BODY_LIMIT = 4096


def engine_config(path: str, **kw: object) -> EngineConfig:
    base = dict(
        model=path,
        backend="torch",
        dtype="float32",
        block_size=4,
        num_kv_blocks=512,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        served_model_name=MODEL_NAME,
    )
    base.update(kw)
    return EngineConfig.from_kwargs(**base)


def slow_steps(eng: AsyncLLM, seconds: float) -> None:
    """Make every engine step take at least `seconds`, so timing tests do not depend on how
    fast the machine decodes (a fast CI machine finishes the tiny model's requests early)."""
    step = eng.engine.step

    def slow_step() -> list:
        time.sleep(seconds)
        return step()

    eng.engine.step = slow_step


def wait_until(cond, timeout: float = 10.0, interval: float = 0.05) -> bool:  # noqa: ANN001
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def metric(text: str, name: str) -> float:
    """Value of the first series of metric `name` in Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def http(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one plain HTTP request (no client-side retries or checks)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@dataclass
class Server:
    base_url: str
    app: web.Application
    engine: AsyncLLM


class ServerThread:
    """Runs an aiohttp app in a background event loop (like `xlaserve serve`, in-process)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.port: int = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.app, **RUNNER_KWARGS)  # as run_server does
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def start(self) -> str:
        self._thread.start()
        assert self._ready.wait(30), "server did not start"
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


def serve(
    engine: AsyncLLM, config: ServerConfig | None = None, owns_engine: bool = False
) -> Iterator[Server]:
    app = build_app(engine, config, owns_engine=owns_engine)
    st = ServerThread(app)
    url = st.start()
    try:
        yield Server(url, app, engine)
    finally:
        st.stop()
