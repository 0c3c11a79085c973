"""Helpers for the reliability tests (plain module: test files import it by name).

`Client` drives one aiohttp session from synchronous test code (hypothesis tests are sync): each
request has a client-side timeout, so a hung server fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any

import aiohttp

# The OpenAI error body: {"error": {"message", "type", "param", "code"}}.
ERROR_KEYS = {"message", "type", "param", "code"}
REQUEST_TIMEOUT_S = float(os.environ.get("XLASERVE_FUZZ_TIMEOUT", "60"))


def rss_bytes() -> int:
    """Resident memory of this process (psutil when installed, else /proc/self/status)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read RSS")


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    events: list[Any] | None = None  # decoded SSE `data:` payloads ("[DONE]" kept as a str)

    def json(self) -> Any:
        return json.loads(self.body)


def check_error_body(reply: Reply) -> dict[str, Any]:
    """Assert the reply is OpenAI's error JSON; return the inner error object."""
    body = reply.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    return err


def parse_sse(body: bytes) -> list[Any]:
    events: list[Any] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: "):
            payload = line[6:].decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


class Client:
    """A private event loop + aiohttp session for synchronous callers."""

    def __init__(self, base_url: str, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.base_url = base_url
        self.loop = asyncio.new_event_loop()
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session = self.loop.run_until_complete(self._session())

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=self.timeout)

    async def _send(
        self, method: str, path: str, data: bytes | None, headers: dict[str, str]
    ) -> Reply:
        async with self.session.request(
            method, self.base_url + path, data=data, headers=headers
        ) as r:
            body = await r.read()
            events = parse_sse(body) if r.content_type == "text/event-stream" else None
            return Reply(r.status, dict(r.headers), body, events)

    def send(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        content_type: str | None = "application/json",
    ) -> Reply:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": content_type} if content_type else {}
        return self.loop.run_until_complete(self._send(method, path, data, headers))

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())
        self.loop.close()
