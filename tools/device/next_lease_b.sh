# The next lease's second call (<= 10 min): issue 24's fp8 GEMM re-sweep (the Triton kernel's
# operands are typed since the eighteenth session), quant_bench's bf16 / fp8 rows with the
# sweep's picks (through the hooks, no commit needed), and the Triton prefill tile sweep.
source tools/device/setup.sh
stamp fp8 GEMM sweep
timeout 150 python3 bench/gpu_probes/quant_gemm_sweep.py --families fp8 --ms 16 256 4096 \
    --out "$OUT/quant_gemm_fp8.json" 2>&1 | grep -E "bf16 |suggest|best|rror" | tail -20
stamp quant_bench fp8 with the picks
DEVRUN_W8A8_AUTO_JSON="$OUT/quant_gemm_fp8.json" timeout 270 python3 bench/quant_bench.py \
    --llama8b --rows bf16,fp8 --repeats 2 --output-json "$OUT/qb_fp8.json" 2>&1 \
    | grep -v "^\[devrun" | tail -12
stamp prefill tiles
timeout 130 python3 bench/gpu_probes/prefill_tile_sweep.py --out "$OUT/prefill_tiles.json" 2>&1 \
    | grep -E "best|table|rror" | tail -8
stamp done
