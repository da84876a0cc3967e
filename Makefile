# make demo: train the demo model on 8 simulated CPU devices, then print a sample from it.   make test: run the test suite.
# Each creates .venv (python3 -m venv) when missing and installs what it needs.
# make test-gpu-compile: compile the real train step for an H200 on this machine (no GPU needed) and check its
# memory and kernels; it creates .venv-gpu with the CUDA build of JAX (about 5.5 GB of wheels).
# Every install pins what CI passes with (constraints.txt); make lock rewrites it from the versions in .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
LOCK := constraints.txt

GPU_VENV := .venv-gpu
JAX_VERSION = $(shell $(BIN)/python -c "import jax; print(jax.__version__)")

.PHONY: demo test test-full test-gpu-compile gpu-wheels install install-dev lock clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml $(LOCK) | $(BIN)/python
	$(PIP) install -c $(LOCK) -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(LOCK) | $(BIN)/python
	$(PIP) install -c $(LOCK) -e ".[dev,convert,plot]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# constraints.txt from the versions installed in .venv (upgrade one there first: .venv/bin/pip install -U NAME).
# A new JAX: pyproject.toml bounds jax to the minor version tested (the zero-bubble schedules' backward split,
# jaxseek/pipeline/wsplit.py, reads JAX internals). Install it in .venv (.venv/bin/pip install "jax==X.Y.Z"),
# run make test-full, then raise the bound in pyproject.toml and wsplit.TESTED_JAX, and make lock.
lock: | $(VENV)/.installed-dev
	$(BIN)/python scripts/lock.py --extras dev,convert,plot --out $(LOCK)

demo: $(VENV)/.installed
	$(BIN)/python -m jaxseek.train --config configs/demo.yaml
	$(BIN)/python -m jaxseek.generate --checkpoint runs/demo --tokenizer byte --prompt "def main():" --max-new-tokens 64 \
	  --temperature 0.7 --top-k 40

# A test whose worker process dies (a native library's crash) runs once more in a new worker; a test that fails an
# assertion or raises is never rerun (--only-rerun matches no failure's message, only the crash path reruns).
RERUN_CRASHED = --reruns 1 --only-rerun "worker '\w+' crashed"

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n 2 $(RERUN_CRASHED) -m "not slow" tests

# everything, the slow cases too (tests/conftest.py SLOW): about 40 minutes on 2 cores
test-full: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n 2 $(RERUN_CRASHED) tests

# the CUDA packages (jax-cuda12-*, nvidia-*) are not in constraints.txt; everything else is pinned by it
$(GPU_VENV)/.installed: pyproject.toml $(LOCK) | $(VENV)/.installed
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip --disable-pip-version-check -q install -c $(LOCK) -e ".[gpu,dev]" \
	  "jax[cuda12]==$(JAX_VERSION)"
	touch $@

test-gpu-compile: $(GPU_VENV)/.installed
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python -m pytest -q -p no:warnings tests_gpu

# wheels for benchmarks/gpu_suite.sh on a GPU machine without network (Python 3.11-3.13, x86-64 Linux)
gpu-wheels: | $(VENV)/.installed
	mkdir -p benchmarks/wheels
	for v in 3.11 3.12 3.13; do \
	  $(PIP) download --no-deps --only-binary=:all: --python-version $$v --platform manylinux2014_x86_64 \
	    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d benchmarks/wheels \
	    $$(grep -v '^#' benchmarks/gpu-wheels.txt) || exit 1; \
	done

clean:
	rm -rf $(VENV) $(GPU_VENV) runs .pytest_cache
