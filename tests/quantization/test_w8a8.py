"""W8A8 (int8 and fp8 activations), block-wise fp8, and the quality of every quantized mode:
Triton kernels of kernels_cuda/scaled_mm.py vs their torch references (TRITON_INTERPRET=1 on the
CPU), the checkpoint formats (compressed-tensors int-quantized, quant_method fp8 with
weight_block_size) on both backends, and the demo model's perplexity per mode."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from optional_deps import import_or_skip

torch = import_or_skip("torch")
import_or_skip("triton")
import_or_skip("transformers")

from quant_testlib import (  # noqa: E402
    perplexity,
    runner_logits,
    torch_prefill_logits,
    torch_runner,
    write_prequantized,
)

from xlaserve.quantization import QuantScheme, scheme_from_hf_config  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
IDS = [(7 * i + 3) % 380 + 1 for i in range(40)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# ---- per-token activation quantization ----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_rows_matches_reference(fmt: str, dtype: torch.dtype) -> None:
    from xlaserve.kernels_cuda.scaled_mm import quant_rows, quant_rows_ref

    torch.manual_seed(0)
    x = (torch.randn(6, 200) * 3).to(dtype).to(DEV)
    x[2] = 0.0  # an all-zero row: scale clamped, codes 0
    x[3, 7] = 40.0  # an outlier sets its row's scale
    q, s = quant_rows(x, fmt)
    qr, sr = quant_rows_ref(x, fmt)
    assert q.dtype == qr.dtype and s.shape == (6, 1)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    top = 127 if fmt == "int8" else 448
    assert float(q[3, 7].float()) == top  # the row's absmax maps to the top code
    assert not q[2].float().any()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quant_rows_long_rows_two_pass(fmt: str) -> None:
    """K above QUANT_ONE_TILE_MAX_K takes the max pass + cast pass branch."""
    from xlaserve.kernels_cuda import scaled_mm as sm

    torch.manual_seed(1)
    k = sm.QUANT_ONE_TILE_MAX_K + 300
    x = (torch.randn(2, k) * 2).to(DEV)
    q, s = sm.quant_rows(x, fmt)
    qr, sr = sm.quant_rows_ref(x, fmt)
    assert torch.equal(s, sr)
    d = q.float() - qr.float()
    if fmt == "int8":
        assert not d.any()
    else:  # the CPU interpreter's fp8 cast is off by one code on some fp8 subnormals (< 2^-6)
        assert (d[qr.float().abs() >= 2**-6] == 0).all()
        assert d.abs().max() <= 2**-9


def test_quant_rows_rejects_bad_input() -> None:
    from xlaserve.kernels_cuda.scaled_mm import quant_rows

    with pytest.raises(ValueError, match="format"):
        quant_rows(torch.zeros(2, 16, device=DEV), "int4")
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        quant_rows(torch.zeros(16, device=DEV), "int8")
    with pytest.raises(ValueError, match="dtype"):
        quant_rows(torch.zeros(2, 16, dtype=torch.int32, device=DEV), "int8")


def _near_tie_rows(fmt: str, m: int, k: int, seed: int) -> np.ndarray:
    """x f32 [m, k] whose per-token quotients x / xs (xs = amax / QMAX) sit 0 to 2 ulps either
    side of a rounding tie of `fmt` (fp8: halfway between two e4m3 codes; int8: j + 0.5). A
    quantizer that gets xs or x / xs any other way than the two IEEE divisions of
    `quant_rows_ref` (a multiply by a reciprocal, x * (448 / amax)) rounds some of them the other
    way; column 0 holds the row's amax."""
    rng = np.random.default_rng(seed)
    if fmt == "fp8":
        import ml_dtypes

        codes = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        ties, qmax = (codes[:-1] + codes[1:]) / 2, 448.0  # codes 0 .. 448; the halves are exact
    else:
        ties, qmax = np.arange(127, dtype=np.float32) + 0.5, 127.0
    amax = rng.uniform(0.5, 8.0, size=(m, 1)).astype(np.float32)
    xs = amax / np.float32(qmax)
    sign = rng.choice(np.array([-1.0, 1.0], np.float32), size=(m, k))
    x = (rng.choice(ties, size=(m, k)).astype(np.float32) * sign) * xs
    steps = rng.integers(-2, 3, size=(m, k))
    for i in range(2):
        x = np.where(steps > i, np.nextafter(x, np.float32(np.inf)), x)
        x = np.where(steps < -i, np.nextafter(x, np.float32(-np.inf)), x)
    x[:, :1] = amax
    return x.astype(np.float32)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_xla_quant_rows_bit_exact_with_torch(fmt: str) -> None:
    """The XLA backend's per-token activation quantizer (jitted, as in the model) gives the torch
    backend's scales and codes bit for bit, values at rounding ties included. XLA rewrites
    amax / 448 and x / xs into multiplications by reciprocals unless kept from it
    (models_flax.layers._per_token_quotient): then about half the scales are 1 ulp off."""
    jax = import_or_skip("jax")
    if jax.default_backend() != "cpu":
        pytest.skip("bit-exact divisions are the CPU's (accelerators keep XLA's reciprocals)")
    from xlaserve.kernels_cuda.scaled_mm import quant_rows_ref
    from xlaserve.models_flax.layers import quant_rows

    rand = np.random.default_rng(1).standard_normal((32, 256), dtype=np.float32) * 3
    x = np.concatenate([_near_tie_rows(fmt, 32, 256, 0), rand])
    q, s = jax.jit(quant_rows, static_argnums=1)(x, fmt)
    qr, sr = quant_rows_ref(torch.from_numpy(x), fmt)
    np.testing.assert_array_equal(np.asarray(s), sr.numpy())
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), qr.view(torch.uint8).numpy())


# ---- scaled GEMMs -------------------------------------------------------------------------------


def _w8(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if fmt == "int8":
        s = w.abs().amax(1) / 127
        return torch.round(w / s[:, None]).to(torch.int8).to(DEV), s.to(DEV)
    s = w.abs().amax(1) / 448
    return (w / s[:, None]).to(torch.float8_e4m3fn).to(DEV), s.to(DEV)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (19, 72, 160), (70, 48, 64)])
def test_scaled_mm_matches_reference(fmt: str, m: int, n: int, k: int) -> None:
    from xlaserve.kernels_cuda import scaled_mm as sm

    wq, ws = _w8(fmt, n, k, m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEV)
    bias = torch.randn(n).to(DEV)
    ref = sm.w8a8_matmul_ref(x, wq, ws, fmt, bias)
    xq, xs = sm.quant_rows_ref(x, fmt)
    # Explicit split-K too (7th field): 2 and 3 slices, the bias added once.
    for tiles in (None, (16, 16, 32, 2, 4, 1), (32, 64, 16), (16, 16, 32, 2, 4, 1, 2),
                  (32, 64, 16, 8, 4, 2, 3)):  # fmt: skip
        y = sm.scaled_mm(xq, xs, wq, ws, torch.float32, bias, tiles=tiles)
        assert _rel(y, ref) < 1e-5, tiles
    # The public entry points (quantization included), each GEMM variant.
    run = sm.int8_w8a8_matmul if fmt == "int8" else sm.fp8_w8a8_matmul
    gemm = {"int8": ("int_mm", "triton"), "fp8": ("scaled_mm", "triton")}[fmt]
    from xlaserve.config import KernelConfig

    for how in gemm:
        field = "int8_w8a8_gemm" if fmt == "int8" else "fp8_gemm"
        kc = KernelConfig(**{field: how})
        y = run(x, wq, ws, bias, kernels=kc)
        assert y.dtype == x.dtype
        assert _rel(y, ref) < (1e-2 if DEV == "cuda" else 1e-5), how
    y = run(x.to(torch.bfloat16), wq, ws, bias)
    assert y.dtype == torch.bfloat16 and _rel(y, ref) < 3e-2


def test_int8_scaled_mm_by_hand() -> None:
    """Codes and scales picked so the answer is known: y = (xq . wq) * xs * ws + b."""
    from xlaserve.kernels_cuda.scaled_mm import int8_w8a8_matmul

    x = torch.zeros(1, 16, device=DEV)
    x[0, 0], x[0, 1] = 127.0, -63.5  # xs = 1, codes 127 and -64 (half away from zero)
    wq = torch.zeros(2, 16, dtype=torch.int8, device=DEV)
    wq[0, 0], wq[0, 1], wq[1, 1] = 2, 1, -3
    ws = torch.tensor([0.5, 0.25], device=DEV)
    y = int8_w8a8_matmul(x, wq, ws, torch.tensor([1.0, 0.0], device=DEV))
    assert y.tolist() == [[(254 - 64) * 0.5 + 1.0, 192 * 0.25]]


def test_scale_epilogue_of_int_mm() -> None:
    from xlaserve.kernels_cuda.scaled_mm import scale_epilogue

    g = torch.Generator().manual_seed(3)
    acc = torch.randint(-(2**20), 2**20, (37, 150), generator=g, dtype=torch.int32).to(DEV)
    xs, ws, b = torch.rand(37, 1).to(DEV), torch.rand(150).to(DEV), torch.randn(150).to(DEV)
    y = scale_epilogue(acc, xs, ws, b, torch.float32)
    ref = acc.double() * xs.double() * ws.double() + b.double()
    assert _rel(y, ref) < 1e-6
    assert scale_epilogue(acc, xs, ws, None, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("block,n,k", [((32, 32), 96, 128), ((16, 64), 50, 200)])
def test_block_fp8_gemm_matches_reference(block: tuple[int, int], n: int, k: int) -> None:
    from xlaserve.backends_torch.layers.linear import quantize_fp8_block_torch
    from xlaserve.kernels_cuda import scaled_mm as sm
    from xlaserve.quantization.hf_formats import quantize_fp8_block

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    w[: block[0], : block[1]] *= 30  # one block far larger: per-block scales matter
    t = quantize_fp8_block_torch(w, block)
    np_t = quantize_fp8_block(w.numpy(), block)  # the checkpoint writer agrees with torch
    assert np.array_equal(t["qweight"].numpy(), np_t["weight"].view(np.uint8))
    assert np.array_equal(t["scales"].numpy(), np_t["weight_scale_inv"])
    wq, ws = t["qweight"].to(DEV), t["scales"].to(DEV)
    assert ws.shape == sm.block_scale_shape(n, k, block)
    deq = sm.dequant_w8(wq, ws, block)
    assert _rel(deq.cpu(), w) < 0.07  # e4m3: 3 mantissa bits
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(6)).to(DEV)
    ref = sm.w8a8_matmul_ref(x, wq, ws, "fp8", block=block)
    y = sm.fp8_w8a8_matmul(x, wq, ws, block=block)
    assert _rel(y, ref) < (1e-5 if DEV == "cpu" else 2e-2)
    # Split-K slices are whole K steps, so each still lies in one weight block.
    xq, xs = sm.quant_rows_ref(x, "fp8")
    y = sm.scaled_mm(xq, xs, wq, ws, torch.float32, None, block, tiles=(16, 16, 32, 1, 4, 1, 3))
    assert _rel(y, ref) < (1e-5 if DEV == "cpu" else 2e-2)
    with pytest.raises(ValueError, match="weight scales"):
        sm.fp8_w8a8_matmul(x, wq, ws[:, :1], block=block)


# ---- schemes and checkpoints --------------------------------------------------------------------


def test_schemes_from_configs() -> None:
    act = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    w = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}

    def ct(weights: dict, acts: dict | None) -> dict:
        grp = {"weights": weights, "input_activations": acts}
        return {"quant_method": "compressed-tensors", "config_groups": {"g": grp}}

    assert scheme_from_hf_config(ct(w, act)).method == "int8_w8a8"
    assert scheme_from_hf_config(ct(w, None)).method == "int8"
    with pytest.raises(NotImplementedError, match="asymmetric"):
        scheme_from_hf_config(ct({**w, "symmetric": False}, act))
    with pytest.raises(NotImplementedError, match="strategy"):
        scheme_from_hf_config(ct({**w, "strategy": "group"}, act))
    s = scheme_from_hf_config(
        {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    )
    assert (s.method, s.source, s.weight_block) == ("fp8", "fp8-block", (128, 128))
    with pytest.raises(NotImplementedError, match="weight_block_size"):
        scheme_from_hf_config({"quant_method": "fp8"})
    with pytest.raises(ValueError, match="weight_block"):
        QuantScheme("int8", weight_block=(128, 128))


@pytest.fixture(scope="module")
def src(tiny_model_dir) -> str:  # noqa: ANN001
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def ref_logits(src: str) -> np.ndarray:
    return runner_logits(src, IDS)


def _rel_np(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_compressed_tensors_int8_w8a8_loader(src: str, ref_logits: np.ndarray, tmp_path) -> None:  # noqa: ANN001
    qdir = write_prequantized(src, str(tmp_path / "w8a8"), "compressed-tensors-int8")
    got = runner_logits(qdir, IDS)
    assert _rel_np(got, ref_logits) <= 0.1
    # Same codes and scales as runtime int8_w8a8: the same logits.
    np.testing.assert_allclose(got, runner_logits(src, IDS, quantization="int8_w8a8"), atol=1e-5)
    # W8A16 (no input_activations) is int8 weight-only: the runtime int8 logits.
    wdir = write_prequantized(src, str(tmp_path / "w8a16"), "compressed-tensors-int8", w8a16=True)
    np.testing.assert_allclose(
        runner_logits(wdir, IDS), runner_logits(src, IDS, quantization="int8"), atol=1e-5
    )
    with pytest.raises(ValueError, match="conflicts"):
        runner_logits(qdir, IDS, quantization="fp8")


def test_block_fp8_checkpoint_both_backends(src: str, ref_logits: np.ndarray, tmp_path) -> None:  # noqa: ANN001
    """A tiny checkpoint in the DeepSeek-V3 / Qwen3-FP8 layout (weight fp8 + weight_scale_inv
    per 32x32 block; hidden 64 so every layer has several blocks) loads on both backends, and
    each quantized layer computes the same thing on both: fed the same activations (those of the
    torch prefill, plus rows at e4m3 rounding ties), the XLA layer gives the torch layer's output
    (the same codes, f32 math on both)."""
    from xlaserve.backends_torch.layers.linear import QuantLinear

    qdir = write_prequantized(src, str(tmp_path / "fp8b"), "fp8-block", block=(32, 32))
    runner = torch_runner(qdir)  # torch, emulated on CPU (with a warning)
    inputs: dict[str, torch.Tensor] = {}  # each quantized layer's input in the prefill

    def keep(name: str, _mod: torch.nn.Module, args: tuple) -> None:
        inputs[name] = args[0].detach().float().cpu()

    hooks = [
        mod.register_forward_pre_hook(functools.partial(keep, name))
        for name, mod in runner.model.named_modules()
        if isinstance(mod, QuantLinear)
    ]
    got = torch_prefill_logits(runner, IDS)
    for h in hooks:
        h.remove()
    assert _rel_np(got, ref_logits) <= 0.3
    jax = import_or_skip("jax")
    from flax import nnx
    from test_quant_xla import runner_prefill_logits, xla_runner

    from xlaserve.models_flax.layers import QuantLinear as XlaQuantLinear

    xla = xla_runner(qdir)
    got_xla = runner_prefill_logits(xla, IDS)
    # End to end the two backends' logits are not held to each other tightly, by design: their
    # float ops (attention, norms, the order of a dot's sums) differ in the last bits (the float
    # model's logits by ~1e-5), and an activation whose x / xs lies within that noise of an e4m3
    # rounding tie gets codes one step apart on the two backends. The rounding is discontinuous:
    # a ~1e-7 input difference becomes one e4m3 step (1/16 to 1/8) of that element, up to ~0.1
    # in the logits, and k / v carry it to later positions. Random prompts hit such ties now and
    # then (a throwaway run over 200 of them, 2026-12-05, found 17; IDS itself did while XLA's
    # quantizer multiplied by reciprocals, at layer 1's q/k/v input, token 16). So the
    # same-codes claim is checked per layer below, on the same inputs, where it is exact; end to
    # end XLA's fp8 model must be as close to the float one as torch's, and the two must differ
    # by well under the fp8 error itself (in that run a tie moved at most a quarter of it; a
    # layer left float, in bf16 or with wrong scales moves half or more).
    fp8_err = np.abs(got - ref_logits).max()
    assert _rel_np(got_xla, ref_logits) <= 0.3
    assert np.abs(got_xla - got).max() <= 0.5 * fp8_err
    model = nnx.merge(xla.graphdef, xla.state)
    layers = {
        ".".join(map(str, path)): mod
        for path, mod in nnx.iter_modules(model)
        if isinstance(mod, XlaQuantLinear)
    }
    assert sorted(layers) == sorted(inputs) and len(layers) == 14  # 7 projections x 2 layers
    fwd = nnx.jit(lambda mod, x: mod(x))
    for i, (name, x) in enumerate(sorted(inputs.items())):
        x = np.concatenate([x.numpy(), _near_tie_rows("fp8", 8, x.shape[-1], i)])
        tmod = runner.model.get_submodule(name)
        with torch.no_grad():
            want = tmod(torch.from_numpy(x).to(tmod.qweight.device)).float().cpu().numpy()
        with jax.default_matmul_precision("highest"):
            y = np.asarray(fwd(layers[name], jax.numpy.asarray(x)))
        # Same codes on both (one flipped code is >= 1e-3 of the output), f32 sums in another
        # order (3e-7 at most in the throwaway run above).
        assert _rel_np(y, want) <= 1e-5, name


# ---- quality: perplexity of every quantized mode on the demo model -------------------------------


def test_demo_perplexity_every_mode_within_2_percent(monkeypatch) -> None:  # noqa: ANN001
    from test_quant_model import HELD_OUT_TEXT

    from xlaserve.demo import demo_model_path
    from xlaserve.tokenizer import Tokenizer

    monkeypatch.setenv("XLASERVE_FP8_EMULATION", "1")  # fp8 on the CPU: emulated
    d = demo_model_path()
    ids = Tokenizer.from_dir(d).encode(HELD_OUT_TEXT)
    modes = {
        "float": {},
        "int8": {"quantization": "int8"},
        "int8_w8a8": {"quantization": "int8_w8a8"},
        "fp8": {"quantization": "fp8"},
        "int4": {"quantization": "int4"},
        "fp8_kv": {"kv_cache_dtype": "fp8"},
    }
    ppl = {name: perplexity(runner_logits(d, ids, **kw), ids) for name, kw in modes.items()}
    print(f"demo perplexity by mode: {ppl}")  # -s: the figure for bench/RESULTS.md
    assert 15.0 < ppl["float"] < 22.0
    for name, p in ppl.items():
        assert p <= ppl["float"] * 1.02, (name, p, ppl["float"])


# ---- GPU at real shapes --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("m", [1, 16, 256, 2048])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_gpu_w8a8_real_shapes(m: int, n: int, k: int) -> None:
    from xlaserve.backends_torch.layers.linear import fp8_supported, quantize_fp8_block_torch
    from xlaserve.config import KernelConfig
    from xlaserve.kernels_cuda import scaled_mm as sm

    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = _w8("int8", n, k, 0)
    ref = sm.w8a8_matmul_ref(x, wq, ws, "int8").float()
    for how in ("int_mm", "triton"):
        y = sm.int8_w8a8_matmul(x, wq, ws, kernels=KernelConfig(int8_w8a8_gemm=how))
        assert _rel(y, ref) < 1e-2, how
    xq, xs = sm.quant_rows(x, "int8")
    xq_r, xs_r = sm.quant_rows_ref(x, "int8")
    assert torch.equal(xs, xs_r) and (xq.int() - xq_r.int()).abs().max() <= 1
    if not fp8_supported("cuda"):
        return
    wq, ws = _w8("fp8", n, k, 0)
    ref = sm.w8a8_matmul_ref(x, wq, ws, "fp8").float()
    for how in ("scaled_mm", "triton"):
        y = sm.fp8_w8a8_matmul(x, wq, ws, kernels=KernelConfig(fp8_gemm=how))
        assert _rel(y, ref) < 2e-2, how
    t = quantize_fp8_block_torch(torch.randn(n, k, device="cuda"), (128, 128))
    ref = sm.w8a8_matmul_ref(x, t["qweight"], t["scales"], "fp8", block=(128, 128)).float()
    y = sm.fp8_w8a8_matmul(x, t["qweight"], t["scales"], block=(128, 128))
    assert _rel(y, ref) < 2e-2


def test_int8_w8a8_xla_matches_torch(src: str) -> None:
    """Runtime int8_w8a8 on the XLA backend (per-token int8, int8 x int8 -> int32 dot) gives the
    torch backend's logits."""
    import_or_skip("jax")
    from test_quant_xla import xla_logits

    got = xla_logits(src, IDS, quantization="int8_w8a8")
    ref = runner_logits(src, IDS, quantization="int8_w8a8")
    assert np.abs(got - ref).max() <= 2e-4


# ---- int8 weight-only tl.dot at large M (tile table per M bucket) --------------------------------


@pytest.mark.parametrize("m", [9, 40, 100, 300])
def test_int8_weight_only_dot_tile_buckets(m: int) -> None:
    """Every INT8_DOT_TILES bucket (grouped launch order, ragged M / N / K edges) and explicit
    6-value tiles match the reference."""
    from xlaserve.kernels_cuda import quant_matmul as qm

    n, k = 136, 200
    wq, ws = _w8("int8", n, k, m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEV)
    ref = qm.int8_matmul_ref(x, wq, ws)
    assert _rel(qm.int8_matmul(x, wq, ws), ref) < 1e-5
    assert _rel(qm.int8_matmul(x, wq, ws, tiles=(32, 32, 32, 3, 4, 2)), ref) < 1e-5
    assert qm.int8_dot_tiles(m) == next(t for mm, t in qm.INT8_DOT_TILES if m <= mm)


@pytest.mark.parametrize("m", [3, 16, 40, 100])
@pytest.mark.parametrize("tiles", [(16, 64, 32, 1, 4, 2, True), (32, 64, 64, 3, 4, 2, True)])
def test_int8_weight_only_swap_ab_kernel(m: int, tiles: tuple) -> None:
    """The swapped kernel (y^T = W x^T, the weight as the dot's first operand) matches the
    reference on ragged M / N / K edges, M below the GEMV bound included (an `Int8DotTiles` there
    runs the tl.dot kernel, not the GEMV)."""
    from xlaserve.kernels_cuda import quant_matmul as qm

    n, k = 136, 200
    wq, ws = _w8("int8", n, k, m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEV)
    ref = qm.int8_matmul_ref(x, wq, ws)
    t = qm.Int8DotTiles(*tiles)
    assert not qm.use_gemv("int8", m, t)
    assert _rel(qm.int8_matmul(x, wq, ws, tiles=t), ref) < 1e-5
    assert _rel(qm._int8_dot(x, wq, ws, t), ref) < 1e-5


def test_int8_dot_split_k_rule(monkeypatch) -> None:  # noqa: ANN001
    """Auto split-K (`dot_split_k`, off by default until timed) on the 8B linears: at M = 256
    the table's 128 x 128 tiles leave down / o at 64 programs (split 4) and qkv at 96 (split 2);
    gate_up (448) and every M = 4096 product keep one slice; an explicit split_k wins (also when
    off); short K never splits below DOT_SPLIT_MIN_STEPS steps per slice."""
    from xlaserve.kernels_cuda import quant_matmul as qm

    assert not qm.DOT_SPLIT_ENABLED
    assert qm.dot_split_k(qm.int8_dot_tiles(256), 256, 4096, 14336) == 1
    assert qm.dot_split_k(qm.Int8DotTiles(128, 128, 64, split_k=4), 256, 4096, 14336) == 4
    monkeypatch.setattr(qm, "DOT_SPLIT_ENABLED", True)
    shapes = {
        "qkv": (4096, 6144),
        "gate_up": (4096, 28672),
        "down": (14336, 4096),
        "o": (4096, 4096),
    }
    got = {
        name: qm.dot_split_k(qm.int8_dot_tiles(256), 256, n, k) for name, (k, n) in shapes.items()
    }
    assert got == {"qkv": 2, "gate_up": 1, "down": 4, "o": 4}
    assert {qm.dot_split_k(qm.int8_dot_tiles(4096), 4096, n, k) for k, n in shapes.values()} == {1}
    assert qm.dot_split_k(qm.int8_dot_tiles(256)._replace(split_k=3), 256, 28672, 4096) == 3
    t = qm.Int8DotTiles(32, 64, 64)
    assert qm.dot_split_k(t, 32, 64, 64 * (2 * qm.DOT_SPLIT_MIN_STEPS - 1)) == 1
    assert qm.dot_split_k(t, 32, 64, 64 * 2 * qm.DOT_SPLIT_MIN_STEPS) == 2


def test_scaled_mm_split_k_rule(monkeypatch) -> None:  # noqa: ANN001
    """`scaled_mm_split_k` (off by default until timed): at M = 256 the w8a8 table's 64 x 128
    tiles give down / o 128 programs (2 slices); qkv (192) and gate_up keep one; explicit
    split_k wins."""
    from xlaserve.kernels_cuda import scaled_mm as sm

    t = sm.scaled_mm_tiles("int8", 256)
    assert not sm.SCALED_MM_SPLIT_ENABLED and sm.scaled_mm_split_k(t, 256, 4096, 14336, 128) == 1
    assert sm.scaled_mm_split_k(t._replace(split_k=3), 256, 4096, 14336, 128) == 3
    monkeypatch.setattr(sm, "SCALED_MM_SPLIT_ENABLED", True)
    shapes = {
        "qkv": (4096, 6144),
        "gate_up": (4096, 28672),
        "down": (14336, 4096),
        "o": (4096, 4096),
    }
    got = {name: sm.scaled_mm_split_k(t, 256, n, k, t.block_k) for name, (k, n) in shapes.items()}
    assert got == {"qkv": 1, "gate_up": 1, "down": 2, "o": 2}
    with pytest.raises(ValueError, match="split_k"):
        sm.check_dot_tiles("x", (16, 16, 32, 1, 4, 1, -1))


@pytest.mark.parametrize("split", [0, 2, 3, 4, 8])
def test_int8_weight_only_split_k_kernel(split: int, monkeypatch) -> None:  # noqa: ANN001
    """Split-K slices (summed in fp32 by the second pass) give the reference on ragged M / N /
    K edges: K 200 in slices of 96 / 64 / 32 keys (split 8 becomes 7: no empty slice), both
    operand orders; split 0 (auto) on a long K splits too (4 slices)."""
    from xlaserve.kernels_cuda import quant_matmul as qm

    monkeypatch.setattr(qm, "DOT_SPLIT_ENABLED", True)
    m, n, k = 40, 72, 200 if split else 1024
    wq, ws = _w8("int8", n, k, split)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(split)).to(DEV)
    ref = qm.int8_matmul_ref(x, wq, ws)
    for swap in (False, True):
        t = qm.Int8DotTiles(32, 64, 32, 2, 4, 2, swap, split)
        assert qm.dot_split_k(t, m, n, k) == (split or 4)
        assert _rel(qm.int8_matmul(x, wq, ws, tiles=t), ref) < 1e-5, swap


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_quant_layers_w8a8_and_int8_large_m() -> None:
    """CUDA layers at an 8B shape: int8_w8a8 (GEMV at M 1, int8 GEMM above), block fp8, and the
    int8 weight-only tiled GEMM at large M, against the float reference of the same codes."""
    from xlaserve.backends_torch.layers.linear import Linear, QuantLinear, fp8_supported
    from xlaserve.kernels_cuda import quant_matmul as qm
    from xlaserve.kernels_cuda import scaled_mm as sm

    torch.manual_seed(0)
    lin = Linear(4096, 6144, True, torch.bfloat16, "cuda")
    torch.nn.init.normal_(lin.weight, std=0.02)
    torch.nn.init.normal_(lin.bias, std=0.02)
    schemes = [QuantScheme("int8_w8a8")]
    if fp8_supported("cuda"):
        schemes.append(QuantScheme("fp8", source="fp8-block", weight_block=(128, 128)))
    for scheme in schemes:
        ql = QuantLinear.from_float(lin, scheme)
        fmt = "int8" if scheme.method == "int8_w8a8" else "fp8"
        for m in (1, 7, 300, 2048):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            ref = sm.w8a8_matmul_ref(x, ql.qweight, ql.scales, fmt, ql.bias, scheme.weight_block)
            if m == 1 and fmt == "int8":  # the weight-only GEMV: x not rounded
                ref = x.float() @ ql.dequantized_weight().t() + ql.bias.float()
            assert _rel(ql(x), ref) < 2e-2, (scheme.method, m)
    q8 = QuantLinear.from_float(lin, QuantScheme("int8"))
    for m in (300, 4096):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        ref = qm.int8_matmul_ref(x, q8.qweight, q8.scales)
        assert _rel(qm.int8_matmul(x, q8.qweight, q8.scales), ref) < 1e-2, m
    # The swapped operand order (wgmma's register operand) on real tiles, M across the buckets.
    for m, tiles in ((16, (16, 64, 128, 1, 4, 4)), (256, (64, 128, 128, 8, 4, 4)),
                     (300, (128, 128, 64, 8, 8, 4)), (4096, (128, 256, 64, 8, 8, 3))):  # fmt: skip
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        ref = qm.int8_matmul_ref(x, q8.qweight, q8.scales)
        t = qm.Int8DotTiles(*tiles, swap_ab=True)
        assert _rel(qm.int8_matmul(x, q8.qweight, q8.scales, tiles=t), ref) < 1e-2, (m, t)
    # Split-K (4 slices, what the auto rule picks for down at M 64 / 256) on the table's tiles.
    lin = Linear(14336, 4096, False, torch.bfloat16, "cuda")
    torch.nn.init.normal_(lin.weight, std=0.02)
    down = QuantLinear.from_float(lin, QuantScheme("int8"))
    for m in (64, 256):
        x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
        t = qm.int8_dot_tiles(m)._replace(split_k=4)
        ref = qm.int8_matmul_ref(x, down.qweight, down.scales)
        assert _rel(qm.int8_matmul(x, down.qweight, down.scales, tiles=t), ref) < 1e-2, m
    # The w8a8 GEMM in 2 slices (the auto rule's pick for down at M 256) against one.
    w8 = QuantLinear.from_float(lin, QuantScheme("int8_w8a8"))
    xq, xs = sm.quant_rows(x, "int8")
    t = sm.scaled_mm_tiles("int8", 256)
    one = sm.scaled_mm(xq, xs, w8.qweight, w8.scales, torch.float32, tiles=t._replace(split_k=1))
    two = sm.scaled_mm(xq, xs, w8.qweight, w8.scales, torch.float32, tiles=t._replace(split_k=2))
    assert _rel(two, one) < 1e-5


def test_kernel_switches_validated() -> None:
    from xlaserve.config import KernelConfig

    kc = KernelConfig.from_env(
        {"XLASERVE_INT8_W8A8_GEMM": "triton", "XLASERVE_INT8_DEQUANT_MIN_M": "4096"}
    )
    assert (kc.int8_w8a8_gemm, kc.int8_dequant_min_m, kc.fp8_gemm) == ("triton", 4096, "auto")
    for field, bad in (("int8_w8a8_gemm", "cutlass"), ("fp8_gemm", "x"), ("act_quant", "")):
        with pytest.raises(ValueError, match=field):
            KernelConfig(**{field: bad})


def test_auto_library_table(monkeypatch) -> None:  # noqa: ANN001
    """KernelConfig "auto" of the w8a8 GEMMs: the library (cuBLASLt) or Triton per M bucket."""
    from xlaserve.kernels_cuda import scaled_mm as sm

    # The defaults (quant_gemm_sweep on the H100): Triton for int8, fp8 above 16 rows the library.
    assert not sm.auto_library("int8", 1) and not sm.auto_library("int8", 1 << 20)
    assert not sm.auto_library("fp8", 16) and sm.auto_library("fp8", 17)
    assert sm.auto_library("fp8", 1 << 20)
    monkeypatch.setitem(sm.AUTO_LIBRARY, "int8", ((256, False), (1 << 62, True)))
    assert [sm.auto_library("int8", m) for m in (17, 256, 257, 8192)] == [False, False, True, True]
    assert sm.auto_library("fp8", 64) and not sm.auto_library("fp8", 8)  # the other keeps its own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_auto_library_routes_by_bucket(monkeypatch) -> None:  # noqa: ANN001
    """With a bucket set to Triton, "auto" skips torch._int_mm there (same result within the
    w8a8 tolerance) and keeps it above."""
    from xlaserve.kernels_cuda import scaled_mm as sm

    calls: list[int] = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    monkeypatch.setitem(sm.AUTO_LIBRARY, "int8", ((256, False), (1 << 62, True)))
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(512, 1024, generator=g) * 0.02).cuda()
    ws = w.abs().amax(1) / 127
    wq = torch.round(w / ws[:, None]).to(torch.int8)
    for m in (64, 512):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        ref = sm.w8a8_matmul_ref(x, wq, ws, "int8")
        assert _rel(sm.int8_w8a8_matmul(x, wq, ws), ref) < 2e-2, m
    assert calls == [512]
