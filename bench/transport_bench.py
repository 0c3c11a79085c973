"""The engine core's transport, measured: one step's output message (every running request's
new token id, finish reason and counters, as engine/core_proc.py sends it) from a sender
process to a receiver process and decoded there, per message, at several batch sizes.

  zmq+msgpack-cols  pyzmq PUSH/PULL over ipc://, msgpack of core.encode_outputs' columns
                    built from CoreOutputs and decoded back to CoreOutputs (what the core does)
  zmq+msgpack  same sockets, msgpack of one list per request
  zmq+pickle   same sockets, pickle frames
  pipe+pickle  multiprocessing.Pipe (a socketpair), pickle (send / recv)

Run: python bench/transport_bench.py [--steps 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import tempfile
import time
from typing import Any

import msgpack
import zmq


def _message(batch: int, logprobs: bool) -> list[Any]:
    # Distinct objects per item (pickle would memoize a shared one), as the core builds them.
    items = [
        [f"{0}#cmpl-{i:032x}", [1000 + i], None, None, None,
         [[[11 + i], [-0.5 - i * 1e-3], 1]] if logprobs else None, None, 0, 0, None, 0, 0]
        for i in range(batch)
    ]  # fmt: skip
    stats = [3, 0, 0.25, 4096, 3000, 10, 5, 0, 100, 1000, 0, 0, 0, 0, 0, 0, 0]
    return [items, stats]


def _core_outputs(batch: int, logprobs: bool) -> list[Any]:
    from xlaserve.engine.core import CoreOutput

    return [
        CoreOutput(f"0#cmpl-{i:032x}", [1000 + i],
                   logprobs=[([11 + i], [-0.5 - i * 1e-3], 1)] if logprobs else None)
        for i in range(batch)
    ]  # fmt: skip


def _sender(kind: str, addr: Any, batch: int, steps: int, logprobs: bool) -> None:  # noqa: ANN401
    msg = _message(batch, logprobs)
    if kind == "zmq+msgpack-cols":  # what the core sends: columns built from CoreOutputs
        from xlaserve.engine.core import encode_outputs

        outs = _core_outputs(batch, logprobs)
        ctx = zmq.Context()
        s = ctx.socket(zmq.PUSH)
        s.connect(addr)
        for _ in range(steps):
            s.send_multipart([b"O", msgpack.packb([encode_outputs(outs), msg[1]])], copy=False)
        s.send_multipart([b"E", b""])
        s.close(linger=-1)
        ctx.term()
        return
    if kind == "pipe+pickle":
        conn = addr
        for _ in range(steps):
            conn.send(msg)
        conn.send(None)
        return
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.connect(addr)
    enc = (
        (lambda m: msgpack.packb(m, use_bin_type=True))
        if kind == "zmq+msgpack"
        else (lambda m: pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL))
    )
    for _ in range(steps):
        s.send_multipart([b"O", enc(msg)], copy=False)
    s.send_multipart([b"E", b""])
    s.close(linger=-1)
    ctx.term()


def _size(kind: str, batch: int, logprobs: bool) -> int:
    msg = _message(batch, logprobs)
    if kind == "zmq+msgpack-cols":
        from xlaserve.engine.core import encode_outputs

        return len(msgpack.packb([encode_outputs(_core_outputs(batch, logprobs)), msg[1]]))
    if kind == "zmq+msgpack":
        return len(msgpack.packb(msg))
    return len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def run(kind: str, batch: int, steps: int, logprobs: bool) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    t0 = 0.0
    n = 0
    if kind == "pipe+pickle":
        rx, tx = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_sender, args=(kind, tx, batch, steps, logprobs))
        p.start()
        first = True
        while True:
            m = rx.recv()
            if first:
                t0, first = time.perf_counter(), False
            if m is None:
                break
            n += len(m[0])
    else:
        d = tempfile.mkdtemp()
        addr = f"ipc://{d}/bench"
        zc = zmq.Context()
        s = zc.socket(zmq.PULL)
        s.bind(addr)
        p = ctx.Process(target=_sender, args=(kind, addr, batch, steps, logprobs))
        p.start()
        dec = (
            (lambda b: msgpack.unpackb(b, raw=False, strict_map_key=False))
            if kind == "zmq+msgpack"
            else pickle.loads
        )
        if kind == "zmq+msgpack-cols":
            from xlaserve.engine.core import decode_outputs

            def dec(b: bytes) -> list[Any]:
                cols, _stats = msgpack.unpackb(b, raw=False, strict_map_key=False)
                return [decode_outputs(cols)]

        first = True
        while True:
            k, payload = s.recv_multipart()
            if first:
                t0, first = time.perf_counter(), False
            if k == b"E":
                break
            got = dec(payload)[0]
            n += len(got)
        s.close(linger=0)
        zc.term()
        os.rmdir(d) if not os.listdir(d) else None
    dt = time.perf_counter() - t0
    p.join()
    msgs = steps - 1  # the clock starts at the first message
    return {
        "transport": kind,
        "batch": batch,
        "logprobs": logprobs,
        "us_per_message": round(dt / msgs * 1e6, 2),
        "messages_per_s": round(msgs / dt),
        "bytes_per_message": _size(kind, batch, logprobs),
        "requests_seen": n,
    }


def codec_us(kind: str, batch: int, logprobs: bool, reps: int = 200) -> tuple[float, float]:
    """(encode, decode) microseconds per message in one process (best of 5 rounds)."""
    import timeit

    msg = _message(batch, logprobs)
    if kind == "msgpack-cols":
        from xlaserve.engine.core import decode_outputs, encode_outputs

        outs = _core_outputs(batch, logprobs)
        enc = lambda: msgpack.packb([encode_outputs(outs), msg[1]])  # noqa: E731
        blob = enc()
        dec = lambda: decode_outputs(msgpack.unpackb(blob)[0])  # noqa: E731
    elif kind == "msgpack":
        enc = lambda: msgpack.packb(msg, use_bin_type=True)  # noqa: E731
        blob = enc()
        dec = lambda: msgpack.unpackb(blob, raw=False, strict_map_key=False)  # noqa: E731
    else:
        enc = lambda: pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)  # noqa: E731
        blob = enc()
        dec = lambda: pickle.loads(blob)  # noqa: E731
    e = min(timeit.repeat(enc, number=reps, repeat=5)) / reps * 1e6
    d = min(timeit.repeat(dec, number=reps, repeat=5)) / reps * 1e6
    return round(e, 2), round(d, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batches", default="1,64,256,1024")
    ap.add_argument("--json", default=None)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for logprobs in (False, True):
            for kind in ("msgpack-cols", "msgpack", "pickle"):
                e, d = codec_us(kind, batch, logprobs)
                rows.append(
                    {"codec": kind, "batch": batch, "logprobs": logprobs, "encode_us": e,
                     "decode_us": d}
                )  # fmt: skip
                print(f"codec {kind:8s} batch={batch:5d} logprobs={int(logprobs)} "
                      f"encode {e:8.1f} us decode {d:8.1f} us")  # fmt: skip
            for kind in ("zmq+msgpack-cols", "zmq+msgpack", "zmq+pickle", "pipe+pickle"):
                steps = max(50, args.steps if batch <= 256 else args.steps // 4)
                # Best of 3 runs: the machine is shared, the minimum is the transport's cost.
                r = min(
                    (run(kind, batch, steps, logprobs) for _ in range(args.runs)),
                    key=lambda x: x["us_per_message"],
                )
                rows.append(r)
                print(
                    f"{kind:12s} batch={batch:5d} logprobs={int(logprobs)} "
                    f"{r['us_per_message']:9.1f} us/msg {r['bytes_per_message']:8d} B"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
