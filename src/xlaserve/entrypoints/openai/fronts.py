"""`xlaserve serve --api-server-count N`: N aiohttp front processes on one port (SO_REUSEPORT:
the kernel spreads connections over them), all clients of ONE engine core process.

Process tree:  server (this process: supervisor, no HTTP)
                 +- engine core (engine/core_proc.py; started first, loads the model)
                 +- front 0 .. N-1 (spawned; each an `MPAsyncLLM` attached to the core's
                    sockets + the OpenAI app; the core routes each request's outputs to the
                    front that sent it)

Each front tokenizes, detokenizes and writes SSE for its own connections, so the front-side work
of many streams spreads over N processes while the GPU work stays in the one core.

Lifetime: SIGTERM / SIGINT here -> the fronts get SIGTERM (they finish their requests' cleanup),
then the core; exit 0. The core dies -> every front fails its requests with 503 and exits 1;
this process then exits 1. A front dies unexpectedly -> everything stops, exit 1. Every child
also exits if this process dies (PR_SET_PDEATHSIG, parent-pid checks).

Metrics: the engine's gauges and counters (from the core's stats snapshots) are the same on
every front; the per-request histograms of /metrics are per front (a scrape sees the front its
connection landed on).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import signal
import threading
from multiprocessing.connection import wait
from typing import Any

from xlaserve.config import EngineConfig, ServerConfig

logger = logging.getLogger("xlaserve.server")

# Seconds the fronts get to stop after SIGTERM before they are killed.
FRONT_STOP_TIMEOUT_S = 15.0


def _front_main(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    ipc_dir: str,
    core_pid: int,
    index: int,
    log_level: int,
) -> None:
    """One front process: attach to the core, serve the app on the shared port."""
    from xlaserve.engine.core_client import AttachedCore, MPAsyncLLM
    from xlaserve.engine.core_proc import _die_with_parent
    from xlaserve.entrypoints.openai.api_server import serve_engine

    _die_with_parent()
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [front {index}]: %(message)s"
    )
    engine = MPAsyncLLM(engine_config, core=AttachedCore(ipc_dir, core_pid))
    if index > 0:  # the engine's stats are the same on every front: one stats line is enough
        server_config = dataclasses.replace(server_config, disable_log_stats=True)
    serve_engine(engine, server_config, reuse_port=True)


def run_fronts(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Start the core and N fronts, supervise them; the exit status (see the module doc)."""
    from xlaserve.engine.core_client import CoreProcess

    n = server_config.api_server_count
    if engine_config.parallel.data_parallel_size > 1:
        raise ValueError(
            "--api-server-count > 1 with --data-parallel-size > 1 is not supported yet: use one "
            "front (the data-parallel ranks are core processes behind it)"
        )
    one = dataclasses.replace(server_config, api_server_count=1)
    core = CoreProcess(engine_config)
    ctx = multiprocessing.get_context("spawn")
    level = logging.getLogger().getEffectiveLevel()
    fronts = [
        ctx.Process(
            target=_front_main,
            args=(engine_config, one, core.ipc_dir, core.pid, i, level),
            name=f"xlaserve-front-{i}",
            daemon=True,
        )
        for i in range(n)
    ]
    for p in fronts:
        p.start()
    logger.info(
        "%d front processes (pids %s) on port %d, engine core pid %d",
        n,
        [p.pid for p in fronts],
        server_config.port,
        core.pid,
    )
    stop = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:  # noqa: ANN401
        stop.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        sentinels = {
            core.sentinel: "core",
            **{p.sentinel: f"front {i}" for i, p in enumerate(fronts)},
        }
        while not stop.is_set():
            ready = wait(list(sentinels), timeout=0.2)
            if not ready:
                continue
            who = sentinels[ready[0]]
            if who == "core":
                logger.error(
                    "the engine core process died (exit code %s); the fronts fail their "
                    "requests and stop",
                    core.exitcode,
                )
                for p in fronts:  # they notice by themselves; give them time to answer 5xx
                    p.join(FRONT_STOP_TIMEOUT_S)
            else:
                logger.error("%s exited unexpectedly; stopping the server", who)
            status = 1
            break
    finally:
        for p in fronts:
            if p.is_alive():
                p.terminate()  # SIGTERM: aiohttp's graceful exit
        for p in fronts:
            p.join(FRONT_STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(5)
        if core.is_alive():
            core.proc.terminate()  # SIGTERM: the core shuts its runner down and exits
        core.stop(30.0)
        for s, h in old.items():
            signal.signal(s, h)
    logger.info("server stopped (status %d)", status)
    return status
