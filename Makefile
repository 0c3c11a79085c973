# xlaserve developer targets. `make install` builds .venv/ (Python 3.11) with pinned versions.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch on machines without an NVIDIA GPU (an unpinned torch pulls a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0
TRANSFORMERS_PIN ?= transformers==5.24.0
# CUTLASS's C++ headers (the wheel's only part used; its Python deps are not needed): the int8
# CUTLASS GEMM builds from them with nvcc where one is installed (kernels_cuda/cutlass_w8a16.py).
CUTLASS_PIN ?= nvidia-cutlass==4.2.0.0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)

.PHONY: install test test-fast test-gpu lint format serve bench soak clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[torch,xla,structured,hf,plot,ray,test]" "$(TRANSFORMERS_PIN)"
	$(BIN)/python -m pip install -q --no-deps "$(CUTLASS_PIN)"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# The README's test command: installs everything, then runs the CPU test suite (GPU/TPU tests skip)
# on two pytest-xdist workers, one test file per worker at a time (a file's module fixtures stay in
# one process): 19.8 vs 27.2 min serial on the 2-core CI machine class. PYTEST_WORKERS=0 runs serially.
PYTEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -q -ra -n $(PYTEST_WORKERS) --dist loadfile tests

test-gpu: install
	$(BIN)/python -m pytest -q -ra -m gpu tests

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

serve: install
	$(BIN)/xlaserve serve

# Thousands of mixed requests against a small, often-preempting KV cache; appends its figures to
# bench/RESULTS.md. Fuzz harder with e.g. XLASERVE_FUZZ_EXAMPLES=1000 pytest tests/reliability.
SOAK_REQUESTS ?= 3000
soak: install
	XLASERVE_SOAK_REQUESTS=$(SOAK_REQUESTS) XLASERVE_SOAK_RESULTS=bench/RESULTS.md \
		$(BIN)/python -m pytest -q -s -m soak tests/reliability/test_soak_server.py

clean:
	rm -rf $(VENV) build *.egg-info
