"""Pallas Triton kernels compiled on a host without a GPU: the kernel's Triton IR from a CUDA
lowering of the jitted call, then pip Triton (the torch backend's) down to sm_90 PTX. Catches
Triton shape / layout / lowering failures in CI. Skips (never passes silently) when JAX's private
lowering API moved or pip Triton cannot read JAX's Triton dialect (version drift)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import pytest
from optional_deps import import_or_skip


def triton_ir_text(fn: Any, args: tuple) -> str:  # noqa: ANN401
    """The kernel's Triton IR (generic MLIR text) from a CUDA lowering done on this CPU host."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering as triton_lowering

        mod = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
        calls = [op for func in mod.body.operations for blk in func.regions[0].blocks
                 for op in blk.operations if op.operation.name == "stablehlo.custom_call"]  # fmt: skip
        config = ir.DictAttr(calls[0].attributes["mhlo.backend_config"])
        data = ir.StringAttr(config["ir"]).value_bytes
        with triton_lowering._new_ir_context():
            return ir.Module.parse(data).operation.get_asm(print_generic_op_form=True)
    except (ImportError, AttributeError, KeyError, IndexError) as e:  # private APIs moved
        pytest.skip(f"cannot extract the Triton IR with jax {jax.__version__}: {e!r}")


def sm90_ptx(fn: Any, args: tuple, tmp_path: Path, monkeypatch: Any) -> str:  # noqa: ANN401
    """`fn(*args)`'s one Pallas kernel compiled by pip Triton for sm_90 (4 warps, 2 stages):
    its PTX. A compile error fails the calling test."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
    triton = import_or_skip("triton")
    from triton.backends.compiler import GPUTarget

    path = tmp_path / "kernel.ttir"
    path.write_text(triton_ir_text(fn, args))
    try:
        from triton._C.libtriton import ir as triton_ir

        ctx = triton_ir.context()
        triton_ir.load_dialects(ctx)
        triton_ir.parse_mlir_module(str(path), ctx)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"triton {triton.__version__} cannot parse JAX's Triton IR: {e}")
    kernel = triton.compile(
        str(path), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2}
    )
    return kernel.asm["ptx"]
