# Sourced first by every device-machine command (the device tool's machines: CUDA, PyTorch,
# Triton and JAX installed, no package registry). Installs the carried wheels (.whl/, git-ignored:
# see tools/device/README.md), xlaserve in editable mode, and puts the table hooks on the path.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH=$PWD/tools/device/hooks:/tmp/site
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,memory.total --format=csv
python3 -c "import xlaserve, torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
stamp() { echo "=== $(date -u +%H:%M:%S) +$(( $(date +%s) - t0 ))s: $*"; }
