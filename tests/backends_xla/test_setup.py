"""Runner set-up without compiling: dtypes, buckets, dummy weights, KV block sizing."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from xla_helpers import make_runner

from xlaserve.backends_xla.utils import (
    dispatch_thread_on,
    make_buckets,
    pick_bucket,
    resolve_dtype,
    seq_buckets,
    token_buckets,
    xla_gpu_flags,
)
from xlaserve.config import KernelConfig


def test_buckets_and_dtypes() -> None:
    assert make_buckets(16, 100) == [16, 32, 64, 100]
    assert make_buckets(1, 4) == [1, 2, 4] and make_buckets(16, 8) == [8]
    assert pick_bucket([16, 32], 17) == 32
    # auto (0): the CPU keeps 1-token / every request bucket; GPU / TPU: tokens from 16,
    # requests 1 then from 16
    assert token_buckets(0, 64, "cpu") == [1, 16, 32, 64] and token_buckets(0, 64, "gpu") == [
        16,
        32,
        64,
    ]
    assert seq_buckets(0, 64, "cpu") == [1, 2, 4, 8, 16, 32, 64]
    assert seq_buckets(0, 64, "gpu") == seq_buckets(0, 64, "tpu") == [1, 16, 32, 64]
    assert seq_buckets(0, 8, "gpu") == [1, 8] and seq_buckets(4, 64, "gpu") == [4, 8, 16, 32, 64]
    assert seq_buckets(0, 1, "gpu") == [1]
    with pytest.raises(ValueError, match="xla_min_seq_bucket"):
        KernelConfig(xla_min_seq_bucket=3)
    with pytest.raises(ValueError, match="exceeds"):
        pick_bucket([16, 32], 33)
    assert resolve_dtype("auto", "bfloat16", "tpu") == jnp.bfloat16
    assert resolve_dtype("auto", "float16", "cpu") == jnp.float32  # no fp16 on CPU
    assert resolve_dtype("float16", "float32", "gpu") == jnp.float16


def test_xla_gpu_flags_and_dispatch_thread_switches() -> None:
    """KernelConfig -> the XLA_FLAGS the runner adds on CUDA, and where the dispatch thread runs."""
    assert xla_gpu_flags(KernelConfig()) == []
    assert xla_gpu_flags(KernelConfig(xla_gpu_autotune_level=0)) == ["--xla_gpu_autotune_level=0"]
    flags = xla_gpu_flags(KernelConfig(xla_triton_gemm="off", xla_gpu_autotune_level=4))
    assert flags == ["--xla_gpu_enable_triton_gemm=false", "--xla_gpu_autotune_level=4"]
    for bad in (5, -2):
        with pytest.raises(ValueError, match="xla_gpu_autotune_level"):
            KernelConfig(xla_gpu_autotune_level=bad)
    with pytest.raises(ValueError, match="xla_dispatch_switch_interval_us"):
        KernelConfig(xla_dispatch_switch_interval_us=-1)
    assert [dispatch_thread_on("auto", p) for p in ("gpu", "tpu", "cpu")] == [True, True, False]
    assert dispatch_thread_on("on", "cpu") and not dispatch_thread_on("off", "gpu")


def test_dummy_weights_and_cpu_kv_blocks(tiny_model_dir, jax_cache_dir) -> None:  # noqa: ANN001
    runner = make_runner(tiny_model_dir("qwen3"), jax_cache_dir, load=False, load_format="dummy",
                         num_kv_blocks=None, cpu_kv_cache_bytes=1 << 20)  # fmt: skip
    runner.load_model()
    norm = runner.state["layers"][1]["self_attn"]["q_norm"]["weight"].get_value()
    assert norm.shape == (32,) and float(norm.min()) == 1.0
    q = runner.state["layers"][0]["self_attn"]["q_proj"]["weight"].get_value()
    assert q.shape == (4 * 32, 64) and 0.01 < float(q.std()) < 0.03
    # Qwen3 tiny: 2 layers x 2 KV heads x head_dim 32 x 4 B x (k, v) = 1024 B per token, 4-token blocks.
    assert runner.determine_num_kv_blocks() == (1 << 20) // (4 * 1024)


def test_bad_tensor_parallel_is_a_clear_error(tiny_model_dir, jax_cache_dir) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="tensor_parallel_size 3 exceeds"):
        make_runner(tiny_model_dir("llama"), jax_cache_dir, load=False, tensor_parallel_size=3)


def test_small_programs_compile_untuned_when_asked(
    tiny_model_dir, jax_cache_dir, monkeypatch
) -> None:  # noqa: ANN001, E501
    """KernelConfig.xla_autotune_small_programs=False: every program of <= 16 matmul rows is
    compiled with XLA's autotuning off, the 32..512-token forwards with XLA's defaults (the
    default since its H200 run); True passes no option at all."""
    import jax

    from xlaserve.backends_xla.programs import UNTUNED_MAX_ROWS, compile_options

    seen: list[dict | None] = []
    real = jax.stages.Lowered.compile

    def spy(self, compiler_options=None, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append(compiler_options)
        return real(self, compiler_options, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    untuned = {"xla_gpu_autotune_level": 0}
    path = tiny_model_dir("llama")
    r = make_runner(path, jax_cache_dir, max_num_batched_tokens=512, max_model_len=512,
                    xla_autotune_small_programs=False)  # fmt: skip
    assert UNTUNED_MAX_ROWS == 16 and r.token_buckets[-1] == 512
    assert (
        compile_options(r, "forward", 16) == untuned and compile_options(r, "sample", 1) == untuned
    )
    # The batch-256 decode step's GEMMs crawl untuned (203 ms a step on the H200): tuned.
    assert compile_options(r, "forward", 256) is None and compile_options(r, "forward", 32) is None
    assert compile_options(r, "verify", 16) == untuned  # no speculative tokens: 1 row each
    r.compile_all()
    big = sum(1 for kind, n in r.programs if n > UNTUNED_MAX_ROWS)
    assert big >= 1 and seen.count(None) >= big
    assert seen.count(untuned) == len(r.programs) - big  # every small program, nothing else
    seen.clear()
    make_runner(path, jax_cache_dir, max_num_batched_tokens=512, max_model_len=512,
                xla_autotune_small_programs=True).compile_all()  # fmt: skip
    assert seen and all(o is None for o in seen)
    assert KernelConfig().xla_autotune_small_programs is False


def test_switch_interval_holds_are_counted() -> None:
    """Two runners in one process: the first shutdown keeps the second's interval; the
    interpreter's own comes back after the last; an interval above it is never set."""
    import sys

    from xlaserve.backends_xla.utils import SwitchIntervalHolds

    holds = SwitchIntervalHolds()
    own = sys.getswitchinterval()
    a, b, c = object(), object(), object()
    try:
        holds.hold(a, own / 10)
        holds.hold(b, own / 5)
        assert sys.getswitchinterval() == pytest.approx(own / 10)
        holds.hold(c, own * 2)  # above the interpreter's: ignored, holds nothing
        assert sys.getswitchinterval() == pytest.approx(own / 10)
        holds.release(a)  # b still holds its interval
        assert sys.getswitchinterval() == pytest.approx(own / 5)
        holds.release(c)  # held nothing: no-op
        holds.release(b)
        assert sys.getswitchinterval() == pytest.approx(own)
        holds.release(b)  # a second release: no-op
        assert sys.getswitchinterval() == pytest.approx(own)
    finally:
        sys.setswitchinterval(own)
