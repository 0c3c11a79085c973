"""`xlaserve serve` as a user runs it (a real subprocess): the engine core is its child process;
kill -9 of the core fails every in-flight and new request fast and the server exits non-zero;
SIGTERM shuts everything down with no orphan process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
from ep_helpers import http, wait_until

START_TIMEOUT = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProc:
    """`python -m xlaserve.entrypoints.cli serve MODEL ...` on a free port, log in a file."""

    def __init__(self, model: str, log_path: str, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "xlaserve.entrypoints.cli", "serve", model,
            "--port", str(self.port), "--backend", "torch", "--dtype", "float32",
            "--block-size", "4", "--num-kv-blocks", "512", "--max-num-seqs", "64",
            "--max-num-batched-tokens", "512", "--served-model-name", "tiny", *extra,
        ]  # fmt: skip
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)

    def wait_healthy(self) -> None:
        end = time.monotonic() + START_TIMEOUT
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.read_log()
            try:
                if http("GET", self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError("server did not start:\n" + self.read_log())

    def core(self) -> psutil.Process:
        kids = [p for p in self.ps.children(recursive=True) if "python" in p.name().lower()]
        cores = [p for p in kids if "spawn_main" in " ".join(p.cmdline())]
        assert len(cores) == 1, [p.cmdline() for p in kids]
        return cores[0]

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture
def serve_proc(tiny_model_dir, tmp_path) -> Iterator[ServeProc]:  # noqa: ANN001
    sp = ServeProc(tiny_model_dir("llama"), str(tmp_path / "serve.log"))
    try:
        sp.wait_healthy()
        yield sp
    finally:
        sp.stop()


def _stream(url: str, out: list, i: int) -> None:
    """One streaming completion; appends (i, status, last line or error) when it ends."""
    import urllib.request

    body = json.dumps(
        {"prompt": f"hello {i}", "max_tokens": 240, "ignore_eos": True, "stream": True}
    ).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            last = b""
            for line in r:  # the error event if there is one (then [DONE] follows), else the last
                if line.strip() and b'"error"' not in last:
                    last = line.strip()
            out.append((i, r.status, last.decode()))
    except Exception as e:  # noqa: BLE001 - HTTP errors and resets are what we record
        code = getattr(e, "code", None)
        text = e.read().decode() if hasattr(e, "read") else str(e)
        out.append((i, code, text))


def test_kill_core_fails_requests_fast_and_server_exits(serve_proc: ServeProc) -> None:
    core = serve_proc.core()
    results: list = []
    threads = [
        threading.Thread(target=_stream, args=(serve_proc.url, results, i), daemon=True)
        for i in range(6)
    ]
    for t in threads:
        t.start()
    # Wait until the requests are running in the core (KV blocks in use), then kill it.
    assert wait_until(
        lambda: "xlaserve:num_requests_running{" in (m := http("GET", serve_proc.url + "/metrics")[2].decode())
        and any(line.startswith("xlaserve:num_requests_running{") and not line.endswith(" 0.0")
                for line in m.splitlines()),
        timeout=30,
    )  # fmt: skip
    os.kill(core.pid, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a request hung after the core died"
    assert len(results) == 6
    failed = 0
    for _, status, last in results:
        # Streams already started end with an OpenAI error event; others get a 5xx JSON; one
        # that finished before the kill ends normally.
        if status == 200 and last == "data: [DONE]":
            continue
        failed += 1
        if status == 200:
            assert '"error"' in last and "engine" in last, last
        else:
            assert status is not None and status >= 500, (status, last)
    assert failed > 0
    # /health says 503 while the server lives; then the server exits non-zero, logging why.
    code = serve_proc.proc.wait(30)
    assert code != 0
    assert time.monotonic() - killed < 30
    assert "engine core process died" in serve_proc.read_log()


def test_new_request_after_core_death_gets_503(serve_proc: ServeProc) -> None:
    core = serve_proc.core()
    os.kill(core.pid, signal.SIGKILL)
    status, _, body = None, None, b""
    for _ in range(50):  # the server exits ~1 s after noticing; catch it before
        try:
            status, _, body = http("GET", serve_proc.url + "/health")
        except OSError:
            break
        if status == 503:
            break
        time.sleep(0.02)
    assert status == 503 and json.loads(body)["error"]["code"] == "engine_dead", body
    try:
        s2, _, b2 = http(
            "POST", serve_proc.url + "/v1/completions", {"prompt": "x", "max_tokens": 2}
        )
        assert s2 == 503 and json.loads(b2)["error"]["type"] == "service_unavailable"
    except OSError:
        pass  # the server already exited: also not a hang
    assert serve_proc.proc.wait(30) != 0


def test_sigterm_leaves_no_orphans(serve_proc: ServeProc) -> None:
    core = serve_proc.core()
    tree = [serve_proc.ps, *serve_proc.ps.children(recursive=True)]
    assert core.pid in {p.pid for p in tree}
    serve_proc.proc.send_signal(signal.SIGTERM)
    assert serve_proc.proc.wait(60) == 0, serve_proc.read_log()
    gone, alive = psutil.wait_procs(tree, timeout=20)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


def test_core_exits_when_server_is_killed(serve_proc: ServeProc) -> None:
    """kill -9 of the server (no clean shutdown): the core notices and exits by itself."""
    core = serve_proc.core()
    serve_proc.proc.kill()
    serve_proc.proc.wait(30)
    gone, alive = psutil.wait_procs([core], timeout=20)
    assert not alive


def _wait_listening(sp: ServeProc, n: int, timeout: float = 30.0) -> set[int]:
    """Pids of the server's children listening on its port, once n of them are (or at the
    timeout): /health can answer from the first front while the second is still binding."""
    pids: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = {
            p.pid
            for p in sp.ps.children()
            if any(c.laddr.port == sp.port and c.status == "LISTEN" for c in p.net_connections())
        }
        if len(pids) >= n:
            break
        time.sleep(0.1)
    return pids


def test_api_server_count_2(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    """Two front processes on one port, one engine core: both listen, every request of many
    concurrent connections completes, and SIGTERM stops all of them."""
    sp = ServeProc(tiny_model_dir("llama"), str(tmp_path / "serve.log"), "--api-server-count", "2")
    try:
        sp.wait_healthy()
        kids = [p for p in sp.ps.children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(kids) == 3, sp.read_log()  # the core + 2 fronts
        listening = _wait_listening(sp, 2)
        assert len(listening) == 2  # the fronts; the core has no TCP socket
        assert listening <= {p.pid for p in kids}
        results: list = []
        threads = [
            threading.Thread(target=_complete, args=(sp.url, results, i), daemon=True)
            for i in range(24)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(r[0] for r in results) == list(range(24))
        assert all(status == 200 and n == 8 for _, status, n in results), results
        tree = [sp.ps, *sp.ps.children(recursive=True)]
        sp.proc.send_signal(signal.SIGTERM)
        assert sp.proc.wait(60) == 0, sp.read_log()
        gone, alive = psutil.wait_procs(tree, timeout=20)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
    finally:
        sp.stop()


def _complete(url: str, out: list, i: int) -> None:
    """One non-streaming completion on its own connection; appends (i, status, tokens)."""
    status, _, body = http(
        "POST",
        url + "/v1/completions",
        {"prompt": f"front test {i}", "max_tokens": 8, "ignore_eos": True},
    )
    n = json.loads(body)["usage"]["completion_tokens"] if status == 200 else -1
    out.append((i, status, n))


def test_api_server_count_2_core_death_exits_nonzero(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    """With two fronts, kill -9 of the core: /health turns 503 (whichever front answers) and the
    whole server exits non-zero, leaving no process behind."""
    sp = ServeProc(tiny_model_dir("llama"), str(tmp_path / "serve.log"), "--api-server-count", "2")
    try:
        sp.wait_healthy()
        tree = [sp.ps, *sp.ps.children(recursive=True)]
        listening = _wait_listening(sp, 2)
        assert len(listening) == 2
        cores = [
            p
            for p in sp.ps.children()
            if "spawn_main" in " ".join(p.cmdline()) and p.pid not in listening
        ]
        assert len(cores) == 1
        os.kill(cores[0].pid, signal.SIGKILL)
        statuses = set()
        for _ in range(20):
            try:
                statuses.add(http("GET", sp.url + "/health")[0])
            except OSError:
                break
            time.sleep(0.02)
        assert 200 not in statuses or 503 in statuses, statuses
        assert sp.proc.wait(60) != 0
        assert "engine core process died" in sp.read_log()
        gone, alive = psutil.wait_procs(tree, timeout=20)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
    finally:
        sp.stop()
