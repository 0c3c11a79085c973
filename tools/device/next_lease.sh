# The next lease's first call (<= 10 min; `run` with carry [".whl"], command
# `bash tools/device/next_lease.sh`): GPU tests of the paths that only the CPU has checked, then
# issue 30's batch-256 rows: the fill thread A/B with per-part phases and a profile in one
# engine, and the engine core in its own process (the server's layout). JSONs land in $OUT.
source tools/device/setup.sh
stamp gpu tests
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels_cuda/test_prefill_sdpa.py \
    tests/quantization/test_w8a8.py 2>&1 | tail -5
stamp structured fill thread A/B
timeout 220 python3 bench/structured_bench.py --llama8b --backend torch --batches 256 --repeats 4 \
    --only-batches --phases --fill-thread ab --profile 30 --output-json "$OUT/so_ab.json" 2>&1 \
    | grep -v INFO > "$OUT/so_ab.log"; grep -E "^\{" "$OUT/so_ab.log" | tail -1 | cut -c1-1500
stamp structured engine process
timeout 170 python3 bench/structured_bench.py --llama8b --backend torch --batches 256 --repeats 4 \
    --only-batches --engine-process --output-json "$OUT/so_proc.json" 2>&1 | grep -v INFO \
    | grep -E "^\{|rror" | tail -2 | cut -c1-1200
stamp done
