"""KernelConfig.xla_decode_gemv: the Flax linears through the Pallas decode GEMV
(kernels_pallas/gemv.py) on the CPU under Pallas' interpreter. The layer equals XLA's dot, the
XLA backend's greedy tokens on the demo model are the same with it on and off, and "auto" keeps
the plain dot where it is not wanted (CPU, TPU, tensor parallelism)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from xla_helpers import drive, make_runner

from xlaserve.demo import demo_model_path
from xlaserve.kernels_pallas import gemv as g
from xlaserve.models_flax.layers import Linear, set_decode_gemv
from xlaserve.sampling_params import SamplingParams


def _linear(d_in: int, d_out: int, dtype: jnp.dtype, bias: bool, seed: int = 0) -> Linear:
    rng = np.random.default_rng(seed)
    lin = Linear(d_in, d_out, dtype, bias=bias)
    lin.weight.set_value(jnp.asarray(rng.normal(size=(d_out, d_in)), dtype))
    if bias:
        lin.bias.set_value(jnp.asarray(rng.normal(size=(d_out,)), dtype))
    return lin


@pytest.mark.parametrize(
    ("m", "d_in", "d_out", "dtype", "bias"),
    [
        (1, 192, 96, jnp.float32, True),  # batch 1 (M padded to 16 inside), demo-like K = 192
        (16, 480, 192, jnp.bfloat16, False),  # a full decode bucket; K tiled by 32
        (5, 256, 64, jnp.float16, True),
    ],
)
def test_gemv_linear_equals_the_plain_dot(m: int, d_in: int, d_out: int, dtype, bias: bool) -> None:  # noqa: ANN001
    lin = _linear(d_in, d_out, dtype, bias, seed=m)
    x = jnp.asarray(np.random.default_rng(7).normal(size=(m, d_in)), dtype)
    want = jax.jit(lambda x: lin(x))(x)
    assert set_decode_gemv(lin, "all") == 1
    fn = jax.jit(lambda x: lin(x))
    assert "pallas_call" in str(jax.make_jaxpr(lambda x: lin(x))(x))  # the GEMV really runs
    got = fn(x)
    assert got.dtype == want.dtype and got.shape == (m, d_out)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    scale = float(np.abs(np.asarray(want, np.float32)).max())
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max() / scale
    assert err < tol, err


def test_gemv_linear_keeps_the_dot_outside_decode_buckets_and_tuned_shapes() -> None:
    lin = _linear(192, 96, jnp.float32, False)
    set_decode_gemv(lin, "all")
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x: lin(x))(jnp.zeros((32, 192))))
    set_decode_gemv(lin, "tuned")  # (96, 192) is no TUNED shape
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x: lin(x))(jnp.zeros((1, 192))))
    assert g.decode_gemv_config("tuned", 16, 14336, 4096, jnp.bfloat16, jnp.bfloat16) is not None
    assert g.decode_gemv_config("all", 16, 96, 200, jnp.bfloat16, jnp.bfloat16) is None  # K 200
    assert g.decode_gemv_config("all", 16, 96, 192, jnp.int8, jnp.int8) is None
    assert g.decode_gemv_config("all", 16, 96, 192, jnp.bfloat16, jnp.float32) is None
    with pytest.raises(ValueError, match="policy"):
        set_decode_gemv(lin, "on")


def test_switch_resolves_by_platform_and_tensor_parallelism() -> None:
    r = g.resolve_decode_gemv
    assert r("auto", "cpu") == "off"  # "auto" on the CPU: the plain dot
    assert r("auto", "gpu") == ("tuned" if g.AUTO_ON_GPU else "off")
    assert r("on", "gpu") == "all" and r("on", "cpu") == "all"
    assert r("on", "tpu") == "off" and r("auto", "tpu") == "off"  # Triton-only kernel
    assert r("on", "gpu", tp_size=2) == "off"  # a pallas_call is not partitioned by GSPMD
    assert r("off", "gpu") == "off"
    with pytest.raises(ValueError, match="xla_decode_gemv"):
        r("yes", "gpu")


def _policies(runner) -> set[str]:  # noqa: ANN001
    model = nnx.merge(runner.graphdef, runner.state)
    return {m.decode_gemv for _, m in nnx.iter_graph(model) if type(m) is Linear}


def test_xla_backend_greedy_tokens_equal_with_the_gemv_on(jax_cache_dir: str) -> None:
    path = demo_model_path()
    prompts = [[5, 17, 300, 42, 9, 1000, 77], [12, 64, 128, 256, 512, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
    got, lps = {}, {}
    for mode in ("off", "on", "auto"):
        kw = dict(max_num_batched_tokens=16, max_num_seqs=2, max_model_len=32)
        runner = make_runner(path, jax_cache_dir, xla_decode_gemv=mode, **kw)
        try:
            # Every step (prefill too) is a GEMV bucket (<= 16 tokens).
            assert runner.token_buckets == [1, 16]
            assert _policies(runner) == {"all" if mode == "on" else "off"}  # "auto": CPU = dot
            got[mode], outs, _ = drive(runner, prompts, params, 4, 16)
            lps[mode] = [o.logprobs[r][0].logprobs[0] for o in outs for r in sorted(o.logprobs)]
        finally:
            runner.shutdown()
    assert got["on"] == got["off"] == got["auto"]
    assert all(len(t) == 4 for t in got["on"]) and len(lps["on"]) == 8
    # The chosen tokens' logprobs too (float32 demo model: only the summation order differs).
    np.testing.assert_allclose(lps["on"], lps["off"], atol=1e-4)


def test_the_switch_is_a_kernel_config_field_env_var_and_cli_flag() -> None:
    from click.testing import CliRunner

    from xlaserve.config import EngineConfig, KernelConfig
    from xlaserve.entrypoints.cli import main

    assert KernelConfig().xla_decode_gemv == "auto"
    assert KernelConfig.from_env({"XLASERVE_XLA_DECODE_GEMV": "1"}).xla_decode_gemv == "on"
    assert EngineConfig.from_kwargs(xla_decode_gemv="off").kernels.xla_decode_gemv == "off"
    with pytest.raises(ValueError, match="XLASERVE_XLA_DECODE_GEMV"):
        KernelConfig.from_env({"XLASERVE_XLA_DECODE_GEMV": "always"})
    with pytest.raises(ValueError, match="xla_decode_gemv"):
        KernelConfig(xla_decode_gemv="always")
    assert "--xla-decode-gemv" in CliRunner().invoke(main, ["serve", "--help"]).output


def test_orbax_restore_carries_the_policy_too(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("orbax.checkpoint")
    from xlaserve.backends_xla.orbax_io import convert_to_orbax
    from xlaserve.backends_xla.utils import make_mesh
    from xlaserve.config import KernelConfig
    from xlaserve.model_loader.registry import build_spec
    from xlaserve.models_flax.loader import load_model

    out = str(tmp_path / "orbax")
    convert_to_orbax(tiny_model_dir("llama"), out)
    got = {}
    for mode in ("off", "on"):
        graphdef, state = load_model(
            build_spec(out), jnp.float32, make_mesh(1), kernels=KernelConfig(xla_decode_gemv=mode)
        )
        model = nnx.merge(graphdef, state)
        got[mode] = {m.decode_gemv for _, m in nnx.iter_graph(model) if type(m) is Linear}
        got[mode + "_leaves"] = len(jax.tree.leaves(state))
    assert got["off"] == {"off"} and got["on"] == {"all"}
    assert got["on_leaves"] == got["off_leaves"]  # the same weights, only the static policy


def test_quantized_linears_keep_their_matmul(tiny_model_dir, jax_cache_dir: str) -> None:  # noqa: ANN001
    from xlaserve.models_flax.layers import QuantLinear

    runner = make_runner(
        tiny_model_dir("llama"), jax_cache_dir, load=False, quantization="int8",
        xla_decode_gemv="on",
    )  # fmt: skip
    try:
        runner.load_model()
        model = nnx.merge(runner.graphdef, runner.state)
        mods = [m for _, m in nnx.iter_graph(model)]
        quant = [m for m in mods if isinstance(m, QuantLinear)]
        floats = [m for m in mods if type(m) is Linear]
        assert quant and not any(hasattr(m, "decode_gemv") for m in quant)
        assert floats and {m.decode_gemv for m in floats} == {"all"}  # lm_head (not quantized)
    finally:
        runner.shutdown()
