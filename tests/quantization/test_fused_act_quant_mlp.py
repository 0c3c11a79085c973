"""KernelConfig.fuse_act_quant: the gated MLP's SiLU-and-mul hands a w8a8 down_proj its input
already quantized (`QuantAct`); the layer's pre-quantized path gives the bits of the float path.
CPU: the layer path under the Triton interpreter, and the gate (never fused off CUDA). GPU: the
whole MLP with the fusion on / off, bit-equal."""

from __future__ import annotations

import pytest
from optional_deps import import_or_skip

torch = import_or_skip("torch")
import_or_skip("triton")

from xlaserve.backends_torch.layers.activation import MLP  # noqa: E402
from xlaserve.backends_torch.layers.linear import (  # noqa: E402
    QuantLinear,
    fp8_supported,
    quantize_linears,
)
from xlaserve.config import KernelConfig  # noqa: E402
from xlaserve.kernels_cuda.quant_act import QuantAct  # noqa: E402
from xlaserve.quantization import QuantScheme  # noqa: E402


def _mlp(method: str, device: str, dtype: torch.dtype, hidden: int = 64, inter: int = 96) -> MLP:
    torch.manual_seed(0)
    mlp = MLP(hidden, inter, dtype=dtype, device=device)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    quantize_linears(mlp, QuantScheme(method), from_weights=True)
    assert isinstance(mlp.down_proj, QuantLinear)
    return mlp


def test_layer_takes_quant_act_int8_on_cpu() -> None:
    # int8_w8a8 on the CPU runs the reference matmul; a QuantAct goes through the interpreter's
    # Triton GEMM. Both are exact integer sums, so the outputs agree to the float rounding.
    from xlaserve.kernels_cuda.scaled_mm import quant_rows_ref

    down = _mlp("int8_w8a8", "cpu", torch.float32).down_proj
    x = torch.randn(5, 96)
    q, s = quant_rows_ref(x, "int8")
    got = down(QuantAct(q, s, x.dtype))
    assert got.shape == (5, 64) and got.dtype == torch.float32
    torch.testing.assert_close(got, down(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="QuantAct"):
        down(QuantAct(q.to(torch.float8_e4m3fn), s, x.dtype))  # an fp8 input for an int8 layer


def test_never_fused_off_cuda() -> None:
    mlp = _mlp("int8_w8a8", "cpu", torch.float32)
    gu = torch.randn(300, 192)
    assert mlp.down_proj.quant_act_fmt(gu[:, :96]) is None
    assert mlp._down_quant_fmt(gu, "silu_and_mul") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("method", ["int8_w8a8", "fp8"])
def test_gpu_mlp_fused_equals_unfused(method: str) -> None:
    if method == "fp8" and not fp8_supported("cuda"):
        pytest.skip("no fp8 GEMM on this GPU")
    mlp = _mlp(method, "cuda", torch.bfloat16, hidden=512, inter=1024)
    mlp.use_triton_ops = True
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    out = {}
    for fuse in (True, False):
        k = KernelConfig(fuse_act_quant=fuse)
        mlp.kernels = k
        for mod in mlp.modules():
            if isinstance(mod, QuantLinear):
                mod.kernels = k
        gu = mlp.gate_up_proj(x)
        fmt = mlp._down_quant_fmt(gu, "silu_and_mul")
        assert fmt == (("int8" if method == "int8_w8a8" else "fp8") if fuse else None)
        out[fuse] = mlp(x)
    assert torch.equal(out[True], out[False])
    mlp.lora_attached = True  # LoRA needs the float input of down_proj: no fusion
    assert mlp._down_quant_fmt(mlp.gate_up_proj(x), "silu_and_mul") is None
