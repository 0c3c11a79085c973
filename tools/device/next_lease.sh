# The next lease's first call (<= 10 min; `run` with carry [".whl"], command
# `bash tools/device/next_lease.sh`): GPU tests of the paths that only the CPU has checked, then
# the sweeps the open issues wait on. Each step has its own timeout; every JSON lands in $OUT.
source tools/device/setup.sh
stamp gpu tests
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels_cuda/test_prefill_sdpa.py \
    tests/quantization/test_w8a8.py 2>&1 | tail -5
stamp fp8 GEMM sweep
timeout 150 python3 bench/gpu_probes/quant_gemm_sweep.py --families fp8 --ms 16 256 4096 \
    --out "$OUT/quant_gemm_fp8.json" 2>&1 | grep -E "suggest|best|rror" | tail -20
stamp structured fill thread A/B
timeout 250 python3 bench/structured_bench.py --llama8b --backend torch --batches 256 --repeats 4 \
    --only-batches --phases --fill-thread ab --profile 30 --output-json "$OUT/so_ab.json" 2>&1 | grep -v INFO \
    > "$OUT/so_ab.log"; grep -E "^\{" "$OUT/so_ab.log" | tail -1 | cut -c1-1500
stamp done
