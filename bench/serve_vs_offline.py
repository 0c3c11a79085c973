"""Served vs offline, in ONE command: the same random prompts through `LLM.generate` and through
`xlaserve serve` + `xlaserve bench serve --request-rate inf`, the batch-1 TPOT both ways, and
the server's engine modes (core in its own process vs in-process; `--api-server-count`).

Stages, each in its own subprocess (GPU memory is returned between them):
  offline        LLM(...).generate(N prompts, input/output len, EOS ignored): output tok/s;
                 batch-1: one 128-token prompt, 256 tokens, TPOT = (t(256) - t(1)) / 255
  serve:<mode>   `xlaserve serve` with that mode, then `xlaserve bench serve` twice:
                 --request-rate inf over the same N prompts (output tok/s, mean TPOT, mean ITL)
                 and --max-concurrency 1 (batch-1 served TPOT)
Modes: `process` (the default: engine core in its own process), `inprocess`
(--no-engine-process), `process-api2` (--api-server-count 2, when the server has it).

Prompts: `xlaserve.bench.datasets.sample_random(N, input_len, output_len, tokenizer, seed)`,
the dataset `bench serve --dataset random --tokenizer MODEL --seed S` draws too, so both sides
get the same texts.

  # H200, Llama-3.1-8B shape, dummy bf16 weights (the model dir is written by gpu_bench):
  python bench/serve_vs_offline.py --llama8b --output-json serve_vs_offline.json
  # CPU smoke test with the demo model:
  python bench/serve_vs_offline.py --num-prompts 16 --input-len 32 --output-len 16 \
      --batch1-output-len 16 --modes process,inprocess --output-json /tmp/svo.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if args.llama8b:
        kw.update(load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.9)
        if args.tiny:  # the same code path on a CPU: the tiny shape, fp32
            kw.update(dtype="float32")
            del kw["gpu_memory_utilization"]
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.backend != "auto":
        kw["backend"] = args.backend
    return kw


def _samples(args: argparse.Namespace) -> list[Any]:
    from xlaserve.bench.datasets import BenchTokenizer, sample_random

    tok = BenchTokenizer(args.model_dir)
    return sample_random(args.num_prompts, args.input_len, args.output_len, tok, seed=args.seed)


# ------------------------------------------------------------------------------- offline stage


def stage_offline(args: argparse.Namespace) -> dict[str, Any]:
    from xlaserve import LLM, SamplingParams

    kw = _engine_kwargs(args)
    llm = LLM(model=args.model_dir, engine_process=args.offline_engine_process, **kw)
    samples = _samples(args)
    prompts = [s.prompt for s in samples]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[: min(8, len(prompts))], sp, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    # Batch-1: TPOT of one request (decode steps only).
    p = prompts[0]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(
        max_tokens=args.batch1_output_len, min_tokens=args.batch1_output_len, temperature=0.0,
        ignore_eos=True,
    )  # fmt: skip
    llm.generate([p], full, use_tqdm=False)
    t1s, tns = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        llm.generate([p], one, use_tqdm=False)
        t1s.append(time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate([p], full, use_tqdm=False)
        tns.append(time.perf_counter() - t)
    t1, tn = sorted(t1s)[len(t1s) // 2], sorted(tns)[len(tns) // 2]
    llm.llm_engine.shutdown()
    return {
        "num_prompts": len(prompts),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "duration_s": dt,
        "output_throughput": n_out / dt,
        "batch1_tpot_ms": (tn - t1) / (args.batch1_output_len - 1) * 1e3,
        "engine_process": args.offline_engine_process,
    }


# ------------------------------------------------------------------------------- serve stage

MODES = {
    "process": [],
    "inprocess": ["--no-engine-process"],
    "process-api2": ["--api-server-count", "2"],
}


def _serve_cmd(args: argparse.Namespace, mode: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "xlaserve.entrypoints.cli", "serve", args.model_dir,
           "--port", str(port)]  # fmt: skip
    for k, v in _engine_kwargs(args).items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd + MODES[mode] + args.serve_arg


def _wait_health(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become healthy")


def _bench_serve(args: argparse.Namespace, url: str, out: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "xlaserve.bench", "serve", "--base-url", url,
           "--tokenizer", args.model_dir, "--ignore-eos", "--seed", str(args.seed),
           "--output-json", out, "--disable-tqdm", *extra]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=args.stage_timeout)
    with open(out) as f:
        r = json.load(f)
    keys = ("completed", "failed", "output_throughput", "mean_tpot_ms", "mean_itl_ms",
            "median_itl_ms", "mean_ttft_ms", "duration")  # fmt: skip
    return {k: r.get(k) for k in keys}


def stage_serve(args: argparse.Namespace, mode: str, work: str) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(work, f"serve-{mode}.log"), "w")  # noqa: SIM115
    proc = subprocess.Popen(_serve_cmd(args, mode, port), stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_health(url, proc, args.start_timeout)
        warm = ["--num-prompts", "8", "--input-len", str(args.input_len), "--output-len", "8",
                "--request-rate", "inf"]  # fmt: skip
        _bench_serve(args, url, os.path.join(work, f"warm-{mode}.json"), warm)
        full = ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--request-rate", "inf"]  # fmt: skip
        res = {"rate_inf": _bench_serve(args, url, os.path.join(work, f"inf-{mode}.json"), full)}
        b1 = ["--num-prompts", str(args.batch1_requests), "--input-len", "128",
              "--output-len", str(args.batch1_output_len), "--max-concurrency", "1",
              "--request-rate", "inf"]  # fmt: skip
        res["batch1"] = _bench_serve(args, url, os.path.join(work, f"b1-{mode}.json"), b1)
        return res
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            res_code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            res_code = proc.wait(30)
        log.close()
        print(f"[{mode}] server exit code {res_code}", file=sys.stderr)


# ------------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--output-json", default="serve_vs_offline.json")
    ap.add_argument("--model-dir", default=None, help="default: the demo model (or --llama8b)")
    ap.add_argument("--llama8b", action="store_true", help="Llama-3.1-8B shape, dummy bf16")
    ap.add_argument("--tiny", action="store_true", help="with --llama8b: 2 tiny layers (CPU test)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch1-output-len", type=int, default=256)
    ap.add_argument("--batch1-requests", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--modes", default="process,inprocess,process-api2")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `serve` flag")
    ap.add_argument("--offline-engine-process", action="store_true")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--stage-timeout", type=float, default=1800)
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stage-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="svo-")
    if args.model_dir is None:
        if args.llama8b:
            from xlaserve.bench.gpu_bench import write_model_dir

            args.model_dir = write_model_dir(
                os.path.join(work, "llama8b"), num_layers=2 if args.tiny else 32, tiny=args.tiny
            )
        else:
            from xlaserve.demo import demo_model_path

            args.model_dir = demo_model_path()
    if args.stage == "offline":
        with open(args.stage_out, "w") as f:
            json.dump(stage_offline(args), f)
        return 0
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "stage"}}

    def save() -> None:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)

    out = os.path.join(work, "offline.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--stage", "offline", "--stage-out", out,
           "--model-dir", args.model_dir, *(argv if argv is not None else sys.argv[1:])]  # fmt: skip
    try:
        subprocess.run(cmd, check=True, timeout=args.stage_timeout)
        with open(out) as f:
            report["offline"] = json.load(f)
    except Exception as e:  # noqa: BLE001 - keep the other stages
        report["offline"] = {"error": repr(e)}
    save()
    for mode in args.modes.split(","):
        try:
            report[f"serve_{mode}"] = stage_serve(args, mode, work)
        except Exception as e:  # noqa: BLE001
            report[f"serve_{mode}"] = {"error": repr(e)}
        save()
    off = report["offline"].get("output_throughput")
    for mode in args.modes.split(","):
        r = report.get(f"serve_{mode}", {})
        inf = r.get("rate_inf") or {}
        if off and inf.get("output_throughput"):
            inf["ratio_to_offline"] = inf["output_throughput"] / off
            if inf.get("mean_tpot_ms"):
                inf["itl_over_tpot"] = (inf.get("mean_itl_ms") or 0) / inf["mean_tpot_ms"]
        b1 = r.get("batch1") or {}
        b1_off = report["offline"].get("batch1_tpot_ms")
        if b1.get("mean_tpot_ms") and b1_off:
            b1["tpot_over_offline"] = b1["mean_tpot_ms"] / b1_off
    save()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
