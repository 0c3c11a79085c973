"""Benchmarks and GPU probes live under bench/; kernel and core packages hold no measurement
scripts (kernel packages: kernels and their references only)."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MOVED = {
    "xlaserve.kernels_cuda.bench_kernels": "xlaserve.bench.kernels.cuda_kernels",
    "xlaserve.kernels_pallas.bench_rpa_gpu": "xlaserve.bench.kernels.rpa_gpu",
    "xlaserve.backends_xla.measure": "xlaserve.bench.xla_measure",
    "xlaserve.spec_decode.bench": "xlaserve.bench.spec_decode",
}
PROBES = ("decode_profile", "gemv_sweep", "offline_probe", "pdl_probe")


def test_measurement_scripts_live_under_bench() -> None:
    for old, new in MOVED.items():
        assert importlib.util.find_spec(old) is None, old
        assert importlib.util.find_spec(new) is not None, new
    for probe in PROBES:
        assert importlib.util.find_spec(f"xlaserve.bench.gpu_probes.{probe}") is not None
    assert not os.path.exists(os.path.join(ROOT, "tools", "gpu_probes"))


def test_kernel_packages_hold_no_benchmarks() -> None:
    for pkg in ("kernels_cuda", "kernels_pallas", "backends_xla", "backends_torch"):
        names = os.listdir(os.path.join(ROOT, pkg))
        assert not [n for n in names if n.startswith(("bench", "measure"))], pkg
