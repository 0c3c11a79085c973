# The next lease (calls of <= 10 min; `run` with carry [".whl"], commands
# `bash tools/device/next_lease.sh N`, N = 1..6); the twenty-second session's closing
# note says why. Part 1 (ran on the H200, 19:49 UTC): the int8 family of the GEMM sweep, its GPU
# test, quant_bench bf16 / int8 with the table and with the sweep's picks
# (DEVRUN_INT8_TILES_JSON), then the batch-256 decode attention over bf16 and fp8 caches.
# Part 2: quant_bench's rows as on main, side by side with bf16, then A/B rows of the decode
# tiles (fp8 KV with the old 64-key tile, bf16 with the 128-key one). Part 3: the CUTLASS int8
# GEMM (KernelConfig.int8_gemm="cutlass"; needs the nvidia-cutlass wheel in .whl/,
# tools/device/README.md): its GPU tests, the sweep (with the split-K candidates) and quant_bench
# against the Triton kernel. Part 4: auto split-K of the int8 weight-only and w8a8 GEMMs end to
# end, and the int8 prefill-dequantized route. Part 5: the 30k / 128k long-context figures with
# the measured copy rate. Part 6: the decode profiles.
source tools/device/setup.sh
if [ "${1:-1}" = 1 ]; then
    stamp int8 GEMM sweep
    timeout 200 python3 bench/gpu_probes/quant_gemm_sweep.py --families int8 --ms 16 256 4096 \
        --out "$OUT/qg_int8.json" 2>&1 | grep -E "^best|^suggest|Error" | tail -24
    stamp GPU tests, int8 large M
    timeout 120 python3 -m pytest -q -m gpu tests/quantization/test_w8a8.py -k "large_m" 2>&1 | tail -3
    stamp quant_bench bf16, int8 table, int8 sweep picks
    timeout 150 python3 bench/quant_bench.py --llama8b --rows bf16,int8 \
        --output-json "$OUT/qb_table.json" 2>&1 | grep -v INFO | tail -4
    DEVRUN_INT8_TILES_JSON="$OUT/qg_int8.json" timeout 100 python3 bench/quant_bench.py --llama8b \
        --rows int8 --output-json "$OUT/qb_picks.json" 2>&1 | grep -v INFO | tail -3
    for kv in bf16 fp8; do
        stamp attention sweep batch 256, $kv cache
        timeout 100 python3 bench/gpu_probes/long_decode_sweep.py --shapes ctx384_b256 --kv $kv \
            --out "$OUT/ld_b256_$kv.json" 2>&1 | grep -E "^ctx|^best" | tail -8
    done
elif [ "$1" = 2 ]; then
    stamp quant_bench
    timeout 330 python3 bench/quant_bench.py --llama8b \
        --rows ${ROWS:-bf16,fp8,int8_w8a8,fp8_kv,fp8_fp8kv} \
        --output-json "$OUT/quant.json" 2>&1 | grep -v INFO | tail -8
    # A/B in the same lease: fp8 KV with the decode table's old tile, bf16 with the 128-key one.
    stamp quant_bench fp8_kv, old decode tile 64,4,3
    DEVRUN_QUANT_DECODE_TILE=64,4,3 timeout 90 python3 bench/quant_bench.py --llama8b \
        --rows fp8_kv --repeats 2 --output-json "$OUT/quant_kv_old.json" 2>&1 | grep -v INFO | tail -2
    stamp quant_bench bf16, decode tile 128,4,3
    DEVRUN_DECODE_TILE=128,4,3 timeout 90 python3 bench/quant_bench.py --llama8b \
        --rows bf16 --repeats 2 --output-json "$OUT/quant_bf16_128.json" 2>&1 | grep -v INFO | tail -2
elif [ "$1" = 3 ]; then
    stamp "GPU tests: int8 split-K, the CUTLASS int8 GEMM (builds it: ~1 min, cached after)"
    timeout 240 python3 -m pytest -q -m gpu tests/quantization/test_w8a8.py \
        tests/kernels_cuda/test_cutlass_w8a16.py -k "large_m or cutlass" 2>&1 | tail -4
    stamp GEMM sweep: CUTLASS configs, int8 split-K candidates
    timeout 120 python3 bench/gpu_probes/quant_gemm_sweep.py --families int8 \
        --ms 64 256 4096 --out "$OUT/qg_cutlass.json" 2>&1 \
        | grep -E "^best|^suggest|Error|cutlass" | tail -30
    stamp quant_bench bf16, int8 Triton, int8 CUTLASS with TILE_BY_M, with the persistent tiles
    timeout 200 python3 bench/quant_bench.py --llama8b --rows bf16,int8,int8_cutlass \
        --repeats 2 --output-json "$OUT/quant_cutlass.json" 2>&1 | grep -v INFO | tail -4
    DEVRUN_CUTLASS_TILES=64:1,0 timeout 80 python3 bench/quant_bench.py --llama8b \
        --rows int8_cutlass --repeats 2 --output-json "$OUT/quant_cutlass_p.json" 2>&1 \
        | grep -v INFO | tail -2
elif [ "$1" = 4 ]; then
    stamp GEMM sweep: w8a8 split-K candidates
    timeout 80 python3 bench/gpu_probes/quant_gemm_sweep.py --families int8_w8a8 --ms 64 256 \
        --out "$OUT/qg_w8a8_split.json" 2>&1 | grep -E "^best|^suggest|Error" | tail -12
    stamp quant_bench bf16, int8, int8 with prefill dequantized to bf16, int8_w8a8
    timeout 260 python3 bench/quant_bench.py --llama8b --rows bf16,int8,int8_dq2048,int8_w8a8 \
        --repeats 2 --output-json "$OUT/quant_int8.json" 2>&1 | grep -v INFO | tail -5
    stamp quant_bench int8 and int8_w8a8 with auto split-K
    DEVRUN_INT8_SPLIT=1 DEVRUN_W8A8_SPLIT=1 timeout 130 python3 bench/quant_bench.py --llama8b \
        --rows int8,int8_w8a8 --repeats 2 --output-json "$OUT/quant_int8_split.json" 2>&1 \
        | grep -v INFO | tail -3
elif [ "$1" = 5 ]; then
    stamp long_context
    timeout 200 python3 bench/long_context.py --llama8b --stages hf,bf16,ctx128k \
        --output-json "$OUT/lc.json" 2>&1 | grep -v INFO | grep -E "TTFT|tok/s|ratio|GB/s" | tail -10
else
    for q in "" fp8_kv fp8; do
        stamp decode profile ${q:-bf16}
        timeout 150 python3 bench/gpu_probes/decode_profile.py 256 8192 1000 $q 2>&1 \
            | grep -v INFO | tail -34
    done
    for q in fp8_kv fp8; do
        python3 bench/gpu_probes/decode_profile.py --compare "$OUT/decode_profile_256.json" \
            "$OUT/decode_profile_256_$q.json" 1.5 2.0
    done
fi
stamp done
