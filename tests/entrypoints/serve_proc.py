"""`xlaserve serve` in a subprocess, as users run it: the tests that use it talk to it only over
HTTP (the official openai client, /metrics), so they hold whatever runs behind the server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

# Engine flags per backend: tiny limits for XLA (every (seqs, tokens) bucket compiles at start).
BACKEND_FLAGS = {
    "torch": ["--max-num-seqs", "16", "--max-num-batched-tokens", "256"],
    "xla": ["--max-num-seqs", "8", "--max-num-batched-tokens", "64"],
}
START_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeProcess:
    """A running `xlaserve serve MODEL --backend B` on 127.0.0.1 (see `start`)."""

    backend: str
    base_url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        """SIGTERM (the server shuts the engine down), then SIGKILL if it does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def start(model: str, backend: str, served_name: str, *extra: str) -> ServeProcess:
    """Start the server and wait until /health answers 200 (raises with the log if it exits or
    does not come up in START_TIMEOUT_S). The caller must `stop()` it."""
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept open for the child's lifetime
        prefix=f"xlaserve-serve-{backend}-", suffix=".log", delete=False
    )
    port = _free_port()
    cmd = [
        sys.executable, "-m", "xlaserve.entrypoints.cli", "serve", model,
        "--backend", backend, "--dtype", "float32", "--block-size", "4",
        "--num-kv-blocks", "512", "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port), *BACKEND_FLAGS[backend], *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServeProcess(backend, f"http://127.0.0.1:{port}", proc, log.name)
    end = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"xlaserve serve exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=5) as r:
                if r.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"xlaserve serve did not come up in {START_TIMEOUT_S}s:\n{server.log()}")
