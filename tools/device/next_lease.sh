# The twentieth session's fourth call (<= 10 min; `run` with carry [".whl"], command
# `bash tools/device/next_lease.sh`): the split route with cuDNN's native GQA and the fused
# log-sum-exp merge (prefill_sdpa.merge_lse): GPU tests, the kernel probe, the 30k TTFT against
# transformers (stages hf, bf16 = the new default, nosdpa), the engine's 30k prefill GPU time with
# prefill_sdpa on, then issue 30's batch-256 row with the engine core in its own process, and a
# cProfile of the in-process plain and constrained runs (where the engine thread's time goes).
source tools/device/setup.sh
stamp gpu tests prefill_sdpa
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels_cuda/test_prefill_sdpa.py \
    2>&1 | grep -E "^E |passed|failed" | tail -8
stamp chunk attention routes
timeout 90 python3 bench/gpu_probes/chunk_attention.py 2>&1 | grep -E "^(padded|split|square)" | tail -8
stamp long_context
timeout 220 python3 bench/long_context.py --llama8b --stages hf,bf16,nosdpa --output-json "$OUT/lc.json" \
    2>&1 | grep -v INFO | grep -E "prefill|TTFT|decode at" | tail -6
stamp prefill profile engine_sdpa
timeout 120 python3 bench/gpu_probes/prefill_profile.py 30000 engine_sdpa 2>&1 | grep -v INFO \
    | grep -v -i warn | tail -12
stamp structured engine process
timeout 100 python3 bench/structured_bench.py --llama8b --backend torch --batches 256 --repeats 4 \
    --only-batches --engine-process --output-json "$OUT/so_proc.json" 2>&1 \
    | grep -E "^\{|rror" | tail -2 | cut -c1-700
stamp structured profile in-process
timeout 110 python3 bench/structured_bench.py --llama8b --backend torch --batches 256 --repeats 1 \
    --only-batches --profile 25 --output-json "$OUT/so_prof.json" 2>&1 | grep -E "^==|^ +[0-9]" \
    | cut -c1-160 | head -56
stamp done
