# Call 4 (nineteenth session; ordered by priority, ~4 minutes of device time were left): issue
# 30's batch 256 with the accept on the fill thread (one engine, alternating off / on) and with
# the engine core in its own process (after the batched-acks fix); the 30k TTFT with the wide
# prefill tiles.
source tools/device/setup.sh
stamp structured fill thread A/B
timeout 90 python3 bench/structured_bench.py --llama8b --backend torch --batches 256 --repeats 2 \
    --only-batches --phases --fill-thread ab --output-json "$OUT/so_ab.json" 2>&1 \
    | grep -E "^\{|rror" | tail -2 | cut -c1-900
stamp structured engine process
timeout 70 python3 bench/structured_bench.py --llama8b --backend torch --batches 256 --repeats 2 \
    --only-batches --engine-process --output-json "$OUT/so_proc.json" 2>&1 \
    | grep -E "^\{|rror" | tail -2 | cut -c1-700
stamp long_context
timeout 80 python3 bench/long_context.py --llama8b --stages hf,bf16 --output-json "$OUT/lc.json" \
    2>&1 | grep -v INFO | grep -E "prefill|TTFT|decode at" | tail -4
stamp done
