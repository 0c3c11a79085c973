# Call 3 (nineteenth session): the SDPA path's transient memory test with its numbers, issue 30's
# engine-process rows after the batched-acks fix (fill thread off / on), and the 30k TTFT with
# the wide prefill tiles against transformers' SDPA and the prefill_sdpa path, in one command.
source tools/device/setup.sh
stamp gpu tests
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels_cuda/test_prefill_sdpa.py \
    tests/kernels_cuda/test_paged_attention_long_decode.py 2>&1 | grep -E "^E |passed|failed" | tail -8
for ft in off on; do
  stamp "structured engine process, fill thread $ft"
  timeout 110 python3 bench/structured_bench.py --llama8b --backend torch --batches 256 --repeats 3 \
      --only-batches --engine-process --fill-thread $ft --output-json "$OUT/so_proc_$ft.json" 2>&1 \
      | grep -E "^\{|rror" | tail -2 | cut -c1-700
done
stamp long_context
timeout 200 python3 bench/long_context.py --llama8b --stages hf,sdpa,bf16 --output-json "$OUT/lc.json" \
    2>&1 | grep -v INFO | grep -E "prefill|TTFT|decode at" | tail -6
stamp done
