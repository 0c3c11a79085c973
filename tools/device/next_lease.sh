# The twentieth session's first call after its opening one (<= 10 min; `run` with carry
# [".whl"], command `bash tools/device/next_lease.sh`), in priority order: the prefill_sdpa
# reserve's GPU test (call_bytes refitted), the grammar accept split over threads (alone, then
# A/B in one engine at batch 256), where the 30k prefill's GPU time goes (ours against
# transformers), then the engine core in its own process with the accept split on.
source tools/device/setup.sh
stamp gpu test transient
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels_cuda/test_prefill_sdpa.py \
    -k "transient" 2>&1 | grep -E "^E |passed|failed" | tail -6
stamp structured fill and accept alone
timeout 70 python3 bench/structured_bench.py --llama8b --tiny --only-fill --batches 256 --repeats 20 \
    --output-json "$OUT/so_fill.json" 2>&1 | grep -E "^\{|rror" | tail -2 | cut -c1-1200
stamp structured accept A/B
timeout 170 python3 bench/structured_bench.py --llama8b --backend torch --batches 256 --repeats 5 \
    --only-batches --accept-ab 4 --output-json "$OUT/so_accept_ab.json" 2>&1 \
    | grep -E "^\{|rror" | tail -2 | cut -c1-1500
stamp prefill profile
timeout 150 python3 bench/gpu_probes/prefill_profile.py 30000 2>&1 | grep -v INFO | tail -26
stamp structured engine process
timeout 100 python3 bench/structured_bench.py --llama8b --backend torch --batches 256 --repeats 4 \
    --only-batches --engine-process --output-json "$OUT/so_proc.json" 2>&1 \
    | grep -E "^\{|rror" | tail -2 | cut -c1-700
stamp done
