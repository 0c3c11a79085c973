"""KV offloading end to end: engine -> scheduler -> block manager -> runner copies.

A device cache too small for two long shared-prefix requests plus a filler: the second
request's prefix comes back from the host tier (or from disk), with the same greedy tokens as
without offloading. Swap preemption gives the same tokens as recompute. Also the torch copy
engine on its own (bf16 bytes survive device -> host -> disk -> host -> device exactly).
"""

from __future__ import annotations

import os

import pytest
import torch

from xlaserve import LLM, SamplingParams
from xlaserve.backends_torch.kv_offload import TorchKVOffload
from xlaserve.metrics import ServerMetrics

PREFIX = list(range(10, 50))  # 40 tokens = 10 blocks of 4
A = PREFIX + [60, 61]
FILLERS = [list(range(100, 140)), list(range(150, 190))]
B = PREFIX + [70, 71, 72]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 16 blocks of 4 tokens: A's 12 blocks cannot survive a 12-block filler on the device.
BASE = dict(dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=64)


def _run(path: str, backend: str, prompts: list[list[int]], **kw: object) -> tuple[list, object]:
    llm = LLM(path, backend=backend, **BASE, **kw)
    outs = [
        llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        for p in prompts
    ]
    return outs, llm.llm_engine


def _block_bytes(engine: object) -> int:
    return engine.kv_manager.offload.block_bytes


@pytest.mark.parametrize("backend", ["torch", "xla"])
def test_host_tier_serves_evicted_prefix(tiny_model_dir, backend: str) -> None:
    path = tiny_model_dir("llama")
    prompts = [A, FILLERS[0], B]
    ref, ref_eng = _run(path, backend, prompts)
    out, eng = _run(path, backend, prompts, kv_offload_bytes=1 << 20)
    s0, s = ref_eng.get_stats(), eng.get_stats()
    assert out == ref
    # Without offload only A's first 4 blocks survive on the device; with it, the other 6
    # prefix blocks of B come back from the host: (43 - 1) // 4 = 10 blocks hit in all.
    assert s0.prefix_cache_hits == 16 and s0.kv_offload_host_hits == 0
    assert s.prefix_cache_hits == 40 and s.kv_offload_host_hits == 24
    bb = _block_bytes(eng)
    assert s.kv_offload_bytes_in == 6 * bb
    assert s.kv_offload_bytes_out >= 6 * bb and s.kv_offload_bytes_out % bb == 0


def test_disk_tier_round_trip(tiny_model_dir, tmp_path) -> None:
    path = tiny_model_dir("llama")
    prompts = [A, *FILLERS, B]
    kw = dict(max_num_batched_tokens=16)
    ref, _ = _run(path, "torch", prompts, **kw)
    # Probe the block size in bytes, then give the host tier room for 4 blocks only.
    _, probe = _run(path, "torch", [A], kv_offload_bytes=1 << 20, **kw)
    bb = _block_bytes(probe)
    disk = tmp_path / "kv"
    out, eng = _run(path, "torch", prompts, kv_offload_bytes=4 * bb, kv_offload_dir=str(disk), **kw)
    s = eng.get_stats()
    assert out == ref
    assert eng.kv_manager.offload.num_slots == 4
    # Two fillers pushed A's prefix out of the host tier onto disk; B reloads it from there
    # (at most 4 blocks per step: each load needs a host slot).
    assert s.kv_offload_disk_hits > 0
    assert eng.kv_manager.offload.disk_bytes_in == s.kv_offload_disk_hits // 4 * bb
    files = [f for d in disk.iterdir() for f in d.iterdir()]
    assert len(files) == len(eng.kv_manager.offload.disk) > 0
    assert all(os.path.getsize(f) > bb for f in files)  # header + raw bytes of one block


@pytest.mark.parametrize("backend", ["torch", "xla"])
def test_swap_preemption_matches_recompute(tiny_model_dir, backend: str) -> None:
    path = tiny_model_dir("llama")
    prompts = [list(range(5, 30)), list(range(40, 61)), list(range(80, 103)), [7] * 18]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, num_kv_blocks=14, max_model_len=56)

    def run(**extra: object) -> tuple[list[list[int]], object]:
        llm = LLM(path, backend=backend, max_num_batched_tokens=64, **kw, **extra)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine.get_stats()

    ref, s_ref = run()
    out, s = run(preemption_mode="swap", kv_offload_bytes=1 << 20)
    assert s_ref.num_preemptions_total > 0 and s.num_preemptions_total > 0
    assert out == ref
    # Preempted requests' full blocks went to the host and came back from there.
    assert s.kv_offload_bytes_out > 0 and s.kv_offload_host_hits > 0
    assert s.prefix_cache_hits > s_ref.prefix_cache_hits


def test_swap_needs_a_host_tier(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="swap"):
        LLM(tiny_model_dir("llama"), backend="torch", preemption_mode="swap", **BASE)


def test_metrics_expose_offload_counters(tiny_model_dir) -> None:
    _, eng = _run(tiny_model_dir("llama"), "torch", [A, FILLERS[0], B], kv_offload_bytes=1 << 20)
    text = ServerMetrics(eng.get_stats, "m").render().decode()
    s = eng.get_stats()
    assert (
        f'xlaserve:kv_offload_host_hits_total{{model_name="m"}} {float(s.kv_offload_host_hits)}'
        in text
    )
    assert (
        f'xlaserve:kv_offload_bytes_out_total{{model_name="m"}} {float(s.kv_offload_bytes_out)}'
        in text
    )
    assert (
        f'xlaserve:kv_offload_bytes_in_total{{model_name="m"}} {float(s.kv_offload_bytes_in)}'
        in text
    )
    assert s.kv_offload_host_hits > 0


def test_cli_has_offload_flags() -> None:
    from click.testing import CliRunner

    from xlaserve.entrypoints.cli import main

    res = CliRunner().invoke(main, ["serve", "--help"])
    assert res.exit_code == 0, res.output
    assert "--kv-offload-bytes" in res.output and "--kv-offload-dir" in res.output
    assert "--preemption-mode" in res.output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_copy_engine_round_trip(tmp_path, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    shape = (6, 4, 2, 8)  # [N, S, Hkv, D]
    caches = [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(3)
    ]
    draft = [(torch.randn(7, 4, 1, 4).to(dtype), torch.randn(7, 4, 1, 4).to(dtype))]
    before = [[(k.clone(), v.clone()) for k, v in grp] for grp in (caches, draft)]
    eng = TorchKVOffload(lambda: [caches, draft], 0, 1, str(tmp_path), num_slots=3)
    assert eng.host[0].shape == (3, 3, 2, 4, 2, 8) and eng.host[1].shape == (3, 1, 2, 4, 1, 4)
    # Blocks 1, 4 -> slots 2, 0; slot 0 -> disk under hash 99, then back into slot 1.
    eng.apply([], [(1, 2), (4, 0)], [], [])
    eng.apply([(0, 99)], [], [(99, 1)], [])
    # Slot 2 -> block 5, slot 1 (block 4's data via disk) -> block 0.
    eng.apply([], [], [], [(2, 5), (1, 0)])
    for grp, ref in zip((caches, draft), before, strict=True):
        for (k, v), (k0, v0) in zip(grp, ref, strict=True):
            assert torch.equal(k[5], k0[1]) and torch.equal(v[5], v0[1])
            assert torch.equal(k[0], k0[4]) and torch.equal(v[0], v0[4])
            for b in (1, 2, 3, 4):
                assert torch.equal(k[b], k0[b]) and torch.equal(v[b], v0[b])
    assert os.listdir(eng.disk_dir) == [f"{99:064x}.npy"]
