# The next lease (two calls of <= 10 min; `run` with carry [".whl"], commands
# `bash tools/device/next_lease.sh 1` then `... 2`), in priority order (the twentieth session's
# closing note says why). Part 1: the prefill_sdpa GPU tests (the split route's checks added
# after the last lease); issue 24's fp8 offline loss (1.25x bf16 against the 1.4x goal) located
# by kernel: the decode step and the full prefill steps of the offline run, bf16 then fp8, side
# by side. Part 2: quant_bench's bf16 / fp8 rows, and the 128k context's TTFT / decode with the
# split prefill route (the ninth session's 16.14 s TTFT predates it).
source tools/device/setup.sh
if [ "${1:-1}" = 1 ]; then
    stamp gpu tests prefill_sdpa
    timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels_cuda/test_prefill_sdpa.py 2>&1 | grep -E "^E |passed|failed" | tail -8
    for q in "" fp8; do
        stamp decode profile ${q:-bf16}
        timeout 220 python3 bench/gpu_probes/decode_profile.py 256 16384 1000 $q 2>&1 \
            | grep -v INFO | tail -34
    done
else
    stamp quant_bench
    timeout 260 python3 bench/quant_bench.py --llama8b --rows bf16,fp8 \
        --output-json "$OUT/quant.json" 2>&1 | grep -v INFO | tail -6
    stamp long_context ctx128k
    timeout 280 python3 bench/long_context.py --llama8b --stages ctx128k \
        --output-json "$OUT/lc128k.json" 2>&1 | grep -v INFO | grep -E "ctx 128000" | tail -2
fi
stamp done
