# The next lease's first call (<= 10 min; `run` with carry [".whl"], command
# `bash tools/device/next_lease.sh`), in priority order (the nineteenth session's closing note says
# why): the prefill_sdpa reserve's GPU test with its numbers, the 30k TTFT with the wide prefill
# tiles against transformers' SDPA and the prefill_sdpa path, then issue 30's batch-256 rows
# (fill thread A/B in one engine with phases; the engine core in its own process).
source tools/device/setup.sh
stamp gpu tests
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels_cuda/test_prefill_sdpa.py \
    tests/kernels_cuda/test_paged_attention_long_decode.py 2>&1 | grep -E "^E |passed|failed" | tail -8
stamp long_context
timeout 200 python3 bench/long_context.py --llama8b --stages hf,sdpa,bf16 --output-json "$OUT/lc.json" \
    2>&1 | grep -v INFO | grep -E "prefill|TTFT|decode at" | tail -6
stamp structured fill thread A/B
timeout 160 python3 bench/structured_bench.py --llama8b --backend torch --batches 256,1 --repeats 4 \
    --only-batches --phases --fill-thread ab --output-json "$OUT/so_ab.json" 2>&1 \
    | grep -E "^\{|rror" | tail -3 | cut -c1-900
stamp structured engine process
timeout 110 python3 bench/structured_bench.py --llama8b --backend torch --batches 256 --repeats 4 \
    --only-batches --engine-process --output-json "$OUT/so_proc.json" 2>&1 \
    | grep -E "^\{|rror" | tail -2 | cut -c1-700
stamp done
