"""A TP=2 server (torch, gloo on the CPU) stops cleanly when a supervisor stops it: SIGTERM to
the whole process group (Ctrl-C, systemd, `timeout`), then again to the server. Exit 0, no
traceback, no gloo "connection reset", no process of the group left. With the engine core in its
own process (the default: the core starts the TP workers) and in the server's process; and in
the middle of generation, where the SIGTERM interrupts the core between two collectives of a
forward (the TP worker is left waiting in one: the core must kill it at once rather than wait for
it, or its exit takes longer than the server waits for it and the server logs a warning)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

START_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,pgid,stat,cmd"], capture_output=True, text=True)
    rows = [ln.split(None, 3) for ln in out.stdout.splitlines()[1:]]
    return [r[3] for r in rows if len(r) == 4 and r[1] == str(pgid) and not r[2].startswith("Z")]


def _stream_until_first_token(base: str, started: threading.Event) -> None:
    """A long streamed completion; sets `started` at its first chunk, then reads until the
    server goes away (it is stopped mid-stream)."""
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True})
    req = urllib.request.Request(
        base + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    started.set()
    except Exception:  # noqa: BLE001, S110 - the connection drops when the server stops
        pass


@pytest.mark.parametrize("mode", ["--engine-process", "--no-engine-process"])
def test_tp2_server_stops_cleanly_on_group_sigterm(tiny_model_dir, mode: str) -> None:  # noqa: ANN001
    _serve_and_stop(tiny_model_dir("llama"), mode, busy=False)


def test_tp2_server_stops_cleanly_on_group_sigterm_mid_generation(tiny_model_dir) -> None:  # noqa: ANN001
    _serve_and_stop(tiny_model_dir("llama"), "--engine-process", busy=True)


def _serve_and_stop(model_dir: str, mode: str, busy: bool) -> None:
    """Serve `model_dir` with TP=2, answer one request, (`busy`: start 4 long streams and wait
    for their first tokens), SIGTERM the group, then check the clean stop."""
    port = _free_port()
    cmd = [sys.executable, "-m", "xlaserve.entrypoints.cli", "serve", model_dir,
           "--backend", "torch", "--dtype", "float32", "--block-size", "4",
           "--num-kv-blocks", "64", "--tensor-parallel-size", "2", mode, "--port", str(port),
           "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    pgid = proc.pid
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + START_TIMEOUT_S
        up = False
        while time.monotonic() < end and proc.poll() is None:
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    up = r.status == 200
                    break
            except OSError:
                time.sleep(0.3)
        assert up, "server did not come up"
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3}).encode()
        req = urllib.request.Request(
            base + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        if busy:
            started = [threading.Event() for _ in range(4)]
            for ev in started:
                threading.Thread(
                    target=_stream_until_first_token, args=(base, ev), daemon=True
                ).start()
            for ev in started:
                assert ev.wait(60), "a streamed request produced no token"
        os.killpg(pgid, signal.SIGTERM)  # every process of the group, as a supervisor does
        time.sleep(0.2)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # and the server once more
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(pgid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "GLHF" not in out and "WARNING" not in out, out
    assert "server stopped" in out
    end = time.monotonic() + 15
    while _group_alive(pgid) and time.monotonic() < end:
        time.sleep(0.2)
    assert _group_alive(pgid) == []
