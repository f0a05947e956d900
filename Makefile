# make test : set up everything on a fresh machine, then run the C++ and Python tests.
# make demo : set up, then run the main job (python -m causal_attention demo).
# make fuzz : set up, then 10,000 property-based examples against the float64 reference on each
#             instruction-set path this CPU runs (tests/attention/fuzz_main.py).
SHELL := /bin/bash
PY    := .venv/bin/python
PIP   := $(PY) -m pip
BUILD := build/py
export OMP_NUM_THREADS ?= 2

CMAKE_DEFINES := -C cmake.define.CA_BUILD_TESTS=ON -C cmake.define.CA_BUILD_BENCHMARKS=ON

.PHONY: all setup install test test-cpp test-py fuzz demo bench sanitize clean

all: test

# Debian packages for the C++ tests and benchmarks, JSON, and the generation program's command line
# and tokenizer (ICU) (root here and in CI).
build/.system-deps:
	@mkdir -p build
	@if [ ! -f /usr/include/gtest/gtest.h ] || [ ! -f /usr/include/benchmark/benchmark.h ] \
	    || [ ! -f /usr/include/nlohmann/json.hpp ] || [ ! -f /usr/include/CLI/CLI.hpp ] \
	    || [ ! -f /usr/include/unicode/regex.h ]; then \
	  echo "installing libgtest-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev libicu-dev"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev libbenchmark-dev \
	    nlohmann-json3-dev libcli11-dev libicu-dev >/dev/null; \
	fi
	@touch $@

# The virtual environment: torch pinned to the CPU wheel on disk, then the build and test tools.
.venv/.deps-stamp: pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "scikit-build-core>=0.10" cmake ninja numpy "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6" \
	  "rich>=13" "matplotlib>=3.7" "safetensors>=0.4" "tqdm>=4.66"
	# Test-only: transformers' GPT-2 is the peer the checkpoint converters are checked against
	# (models are built from configs with random weights; nothing is downloaded).
	$(PIP) install -q "transformers==5.24.0"
	# Test-only: the ONNX exporter's translator (onnxscript, onnx) and the runtime the exported
	# models are checked in (onnxruntime, CPU); versions that work with torch 2.13.
	$(PIP) install -q "onnx==1.23.2" "onnxscript==0.7.2" "onnxruntime==1.32.0"
	@touch $@

setup: build/.system-deps .venv/.deps-stamp

# Builds the engine (and its C++ tests and benchmarks) with CMake through scikit-build-core.
install: setup
	$(PIP) install -q --no-build-isolation --no-deps $(CMAKE_DEFINES) .

# The suites are CPU-bound on two cores: TEST_JOBS processes (ctest's, and pytest-xdist workers that
# take whole files, so that a file's module fixtures are built once), with OpenMP's idle threads
# sleeping instead of spinning, so that the processes' threads share the cores.
TEST_JOBS ?= 2
TEST_ENV := OMP_WAIT_POLICY=PASSIVE

test-cpp: install
	$(TEST_ENV) ctest --test-dir $(BUILD) --output-on-failure -j $(TEST_JOBS)

test-py: install
	$(TEST_ENV) $(PY) -m pytest tests -n $(TEST_JOBS) --dist loadfile --durations=25

test: test-cpp test-py

# A fixed seed: the same 10,000 examples every run; prints the count, failures and worst errors.
FUZZ_THREADS ?= 1
fuzz: install
	$(PY) tests/attention/fuzz_main.py --examples 10000 --threads $(FUZZ_THREADS)

demo: install
	$(PY) -m causal_attention demo

bench: install
	$(PY) -m causal_attention bench
	$(PY) -m causal_attention bench-transformers
	$(PY) -m causal_attention bench-deploy
	$(PY) -m causal_attention bench-half

# The C++ tests under AddressSanitizer and UndefinedBehaviorSanitizer (a separate build).
ASAN_BUILD := build/sanitize
sanitize: setup
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCA_SANITIZE=ON -DCA_BUILD_TESTS=ON \
	  -DPython3_EXECUTABLE=$(CURDIR)/$(PY) -DCMAKE_MAKE_PROGRAM=$(CURDIR)/.venv/bin/ninja >/dev/null
	cmake --build $(ASAN_BUILD)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1\
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --test-dir $(ASAN_BUILD) --output-on-failure

clean:
	rm -rf build demo_out
