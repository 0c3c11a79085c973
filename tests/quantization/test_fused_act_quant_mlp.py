"""KernelConfig.fuse_act_quant: the gated MLP's SiLU-and-mul hands a w8a8 down_proj its input
already quantized (`QuantAct`); the layer's pre-quantized path gives the bits of the float path.
CPU: the layer path under the Triton interpreter, and the gate (never fused off CUDA). GPU: the
whole MLP with the fusion on / off, equal within a code step (not bit-equal on the H100)."""

from __future__ import annotations

import gc

import numpy as np
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU Triton interpreter's test")
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
    _assert_close_to_unfused(out[True], out[False])
    mlp.lora_attached = True  # LoRA needs the float input of down_proj: no fusion
    assert mlp._down_quant_fmt(mlp.gate_up_proj(x), "silu_and_mul") is None


def _assert_close_to_unfused(fused: torch.Tensor, unfused: torch.Tensor) -> None:
    """A fused quantization kernel and the unfused chain give the same codes but for one step
    on a few elements (kernels_cuda/test_fused_act_quant.py `_assert_same`: on the H100 the
    scales differed in the last bit), so a layer's outputs agree to about a bf16 ulp; a lost or
    doubled scale is off by the whole output."""
    torch.testing.assert_close(
        fused.float(), unfused.float(), rtol=0.0, atol=float(unfused.abs().max()) * 2e-2
    )


def test_norm_not_fused_off_cuda() -> None:
    """On the CPU (the consumer's quant_act_fmt is None there) norm_residual_for is the plain
    forward_residual: same outputs, floats, the residual stream started by the first layer."""
    from xlaserve.backends_torch.layers.norm import RMSNorm, norm_residual_for

    mlp = _mlp("fp8", "cpu", torch.float32)
    norm = RMSNorm(64)
    torch.nn.init.normal_(norm.weight, std=0.5)
    x, res = torch.randn(12, 64), torch.randn(12, 64)
    for r in (res, None):
        h, new = norm_residual_for(norm, x, r, mlp.gate_up_proj)
        want_h, want_new = norm.forward_residual(x, r)
        assert isinstance(h, torch.Tensor)
        assert torch.equal(h, want_h) and torch.equal(new, want_new)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("method", ["int8_w8a8", "fp8"])
def test_gpu_decoder_norms_hand_quant_act(method: str, tiny_model_dir) -> None:  # noqa: ANN001
    """With fuse_act_quant on, each decoder layer's two pre-norms hand their w8a8 consumer (the
    fused qkv_proj, the MLP's gate_up_proj) a QuantAct from one rms_norm_quant kernel, and the
    consumer's output is the unfused chain's within a code step, the residual stream bit-equal;
    a forward hook on the consumer (LoRA's) keeps the float input. End to end, greedy tokens
    equal and prompt logprobs close to the fusion off."""
    from xlaserve import LLM, SamplingParams
    from xlaserve.backends_torch.layers.blocks import input_linear
    from xlaserve.backends_torch.layers.norm import norm_residual_for

    if method == "fp8" and not fp8_supported("cuda"):
        pytest.skip("no fp8 GEMM on this GPU")
    model = tiny_model_dir("llama")
    prompt = [(5 * i + 2) % 300 + 1 for i in range(40)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    outs = {}
    for fuse in (True, False):
        llm = LLM(model=model, quantization=method, fuse_act_quant=fuse, dtype="bfloat16",
                  enforce_eager=True, gpu_memory_utilization=0.3)  # fmt: skip
        if fuse:
            torch.manual_seed(0)
            for layer in llm.llm_engine.runner.model.layers:
                h_dim = layer.input_layernorm.weight.shape[0]
                x = torch.randn(40, h_dim, device="cuda", dtype=torch.bfloat16)
                res = torch.randn_like(x)
                for norm, consumer in (
                    (layer.input_layernorm, input_linear(layer.self_attn)),
                    (layer.post_attention_layernorm, input_linear(layer.mlp)),
                ):
                    a, new = norm_residual_for(norm, x, res, consumer)
                    assert isinstance(a, QuantAct), method
                    h, want_new = norm.forward_residual(x, res)
                    assert torch.equal(new, want_new)
                    _assert_close_to_unfused(consumer(a), consumer(h))
                    # The first layer's norm (no residual yet) rounds in torch ops: not fused.
                    assert not isinstance(norm_residual_for(norm, x, None, consumer)[0], QuantAct)
                    hook = consumer.register_forward_hook(lambda *_: None)
                    assert not isinstance(norm_residual_for(norm, x, res, consumer)[0], QuantAct)
                    hook.remove()
        o = llm.generate({"prompt_token_ids": prompt}, sp)[0]
        lps = [next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]
        outs[fuse] = (o.outputs[0].token_ids, lps)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[True][0] == outs[False][0]
    np.testing.assert_allclose(outs[True][1], outs[False][1], atol=5e-2)
