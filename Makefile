# The two README commands: `make quickstart` and `make test`. Both install what they
# need into .venv (idempotent: the install reruns only when the build inputs change).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch is pinned to the CPU build on this machine's disk; every pip call repeats the pin
# so nothing can pull a different (CUDA, several GB) torch.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
BUILD_INPUTS := pyproject.toml setup.py $(wildcard csrc/cpu/*.cpp csrc/cpu/*.h csrc/cpu/*.inc csrc/cuda/*.cu csrc/cuda/*.cuh csrc/cuda/*.h csrc/cuda/bindings/*.cpp csrc/cuda/bindings/*.h csrc/cpu/cxx_runtime.py csrc/cuda/arch_list.py)

.PHONY: install quickstart test test-fast clean

$(STAMP): $(BUILD_INPUTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH) "setuptools>=69" wheel ninja
	# simde-py is an sdist that needs its own build environment (setuptools-scm) for its
	# version, so it is installed before the --no-build-isolation install of the project.
	$(PIP) install -q "simde-py==0.8.2.post1" $(TORCH)
	$(PIP) install -q --no-build-isolation -e '.[test]' $(TORCH)
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/compress run examples/quickstart.yaml

# CUDA kernels: compiled for sm_80 and sm_90 with warnings as errors, 0 spills
# (exit 77 = no nvcc on this machine: reported, not fatal), then the test suite.
test: $(STAMP)
	$(PY) csrc/cuda/check_build.py || test $$? -eq 77
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf build out $(VENV) *.egg-info compress/_C*.so compress/_cuda*.so
