# The twentieth session's third call (<= 10 min; `run` with carry [".whl"], command
# `bash tools/device/next_lease.sh`): the split route for a prefill chunk over a cached prefix
# (prefill_sdpa.split_attention, two cuDNN calls merged by log-sum-exp): GPU tests, the kernel
# probe beside the other routes, where the engine's 30k prefill GPU time goes with
# prefill_sdpa on, and the 30k TTFT against transformers (hf, sdpa, bf16 stages).
source tools/device/setup.sh
stamp gpu tests prefill_sdpa
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels_cuda/test_prefill_sdpa.py \
    2>&1 | grep -E "^E |passed|failed" | tail -8
stamp chunk attention routes
timeout 90 python3 bench/gpu_probes/chunk_attention.py 2>&1 | grep -v Warning | tail -14
stamp prefill profile engine_sdpa
timeout 120 python3 bench/gpu_probes/prefill_profile.py 30000 engine_sdpa 2>&1 | grep -v INFO \
    | grep -v -i warn | tail -12
stamp long_context
timeout 220 python3 bench/long_context.py --llama8b --stages hf,sdpa,bf16 --output-json "$OUT/lc.json" \
    2>&1 | grep -v INFO | grep -E "prefill|TTFT|decode at" | tail -6
stamp done
