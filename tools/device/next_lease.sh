# The twenty-first session's lease (calls of <= 10 min; `run` with carry [".whl"], commands
# `bash tools/device/next_lease.sh 1`, then `... 2`). Part 1: the prefill_sdpa GPU tests (the
# split route's real-shape check has not run on a GPU); the fp8 GEMM sweep with cuBLASLt's
# tensor-wise fp8 GEMM (unit scales: the ceiling; + the in-place scale epilogue: what a layer
# would pay) against the row-wise `_scaled_mm` and Triton, at the decode / prefill M sizes.
# Part 2: quant_bench's bf16 / fp8 rows, then the 128k context's
# TTFT / decode with the split prefill route. Part 3: the GPU tests of the norms' fused
# quantization and the fp8 KV cache's V scales on P; quant_bench's w8a8 rows with
# fuse_act_quant off / on and the fp8 KV row, side by side with bf16.
source tools/device/setup.sh
if [ "${1:-1}" = 1 ]; then
    stamp gpu tests prefill_sdpa
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/kernels_cuda/test_prefill_sdpa.py 2>&1 | grep -E "^E |passed|failed" | tail -8
    stamp fp8 sweep
    timeout 300 python3 bench/gpu_probes/quant_gemm_sweep.py --families fp8 --ms 256 2048 8192 \
        --out "$OUT/fp8_sweep.json" 2>&1 | grep -E "bf16 |scaled_mm|table|best|suggest" | tail -60
elif [ "$1" = 3 ]; then
    stamp gpu tests fused act quant, fp8 KV
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/quantization/test_fused_act_quant_mlp.py tests/kernels_cuda/test_fused_act_quant.py \
        tests/kernels_cuda/test_paged_attention_long_decode.py tests/quantization/test_kv_quant_torch.py \
        2>&1 | grep -E "^E |passed|failed" | tail -10
    stamp quant_bench
    timeout 330 python3 bench/quant_bench.py --llama8b \
        --rows bf16,fp8,fp8_fused,int8_w8a8,int8_w8a8_fused,fp8_kv \
        --output-json "$OUT/quant.json" 2>&1 | grep -v INFO | tail -8
elif [ "$1" = 4 ]; then
    stamp gpu tests: the norms\' fused quantization, fp8 KV V scales on P
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels_cuda/test_fused_act_quant.py \
        tests/quantization/test_fused_act_quant_mlp.py tests/kernels_cuda/test_paged_attention_long_decode.py \
        2>&1 | grep -E "^E |passed|failed" | tail -10
    stamp quant_bench fp8 KV, V scales on P on / off
    DEVRUN_KV_SCALE_ON_P=1 timeout 150 python3 bench/quant_bench.py --llama8b --rows bf16,fp8_kv \
        --output-json "$OUT/quant_on.json" 2>&1 | grep -v INFO | tail -3
    DEVRUN_KV_SCALE_ON_P=0 timeout 90 python3 bench/quant_bench.py --llama8b --rows fp8_kv \
        --output-json "$OUT/quant_off.json" 2>&1 | grep -v INFO | tail -2
elif [ "$1" = 5 ]; then
    stamp gpu tests: fused quantization within a code step
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels_cuda/test_fused_act_quant.py \
        tests/quantization/test_fused_act_quant_mlp.py 2>&1 | grep -E "^E  |passed|failed" | tail -12
    stamp quant_bench w8a8 fuse_act_quant off / on
    timeout 260 python3 bench/quant_bench.py --llama8b \
        --rows bf16,fp8,fp8_fused,int8_w8a8,int8_w8a8_fused \
        --output-json "$OUT/quant.json" 2>&1 | grep -v INFO | tail -6
else
    stamp quant_bench
    timeout 300 python3 bench/quant_bench.py --llama8b --rows ${ROWS:-bf16,fp8} \
        --output-json "$OUT/quant.json" 2>&1 | grep -v INFO | tail -8
    stamp long_context ctx128k
    timeout 250 python3 bench/long_context.py --llama8b --stages ctx128k \
        --output-json "$OUT/lc128k.json" 2>&1 | grep -v INFO | grep -E "ctx 128000" | tail -2
fi
stamp done
