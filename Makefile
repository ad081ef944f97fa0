# X1 — the two commands that do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for local runs and CI; the trainer image installs torch 2.11.0 (CUDA 13.0) itself.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.x1-installed
PYTEST_ARGS ?=
# Two test processes (pytest-xdist): most tests wait on subprocesses, servers and containers.
TEST_WORKERS ?= 2

.PHONY: install test test-docker test-fast demo lint bench-gpu bench-tokenize clean help

help:
	@echo "make demo    - the whole stack as local processes on CPU, then the definition-of-done report"
	@echo "make test    - the test suite (creates $(VENV) when missing)"
	@echo "make test-docker - only the tests on a real Docker Engine (as root, first: bash .ci/docker-setup)"
	@echo "make install - create $(VENV) with every extra"
	@echo "make lint    - ruff, lint-imports (the import contracts), hadolint, compose schema, promtool"
	@echo "make bench-tokenize - tokenizer pipeline vs raw tiktoken, on this machine"
	@echo "make bench-gpu      - the device command for the GPU throughput benchmark (see docs/PERFORMANCE.md)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-docker: $(STAMP)
	$(PY) -m pytest tests/test_docker_engine_api.py tests/test_docker_compose.py tests/test_docker_watchdog.py \
		tests/test_launch.py tests/test_multinode.py $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m x1_pretrain.demo --workspace demo-workspace

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q tests/test_static_checks.py

bench-tokenize: $(STAMP)
	$(PY) bench/tokenize_throughput.py

# The GPU benchmarks run on a machine with a CUDA GPU, from the repo root, through one driver whose
# plans are data (bench/plans.toml); the plain reference script must be reachable as REFERENCE:
#   REFERENCE=path/to/reference_50m.py DATA=path/to/tokenized OUT=out python3 bench/run.py throughput
bench-gpu:
	@echo "On the GPU host, from the repo root (the data: bash bench/device_data.sh .device/data, here):"
	@echo "  REFERENCE=path/to/reference_50m.py DATA=path/to/tokenized OUT=out python3 bench/run.py throughput"
	@echo "The other plans (levers, path, scaling on a 2-GPU host, float8, restart-cost, kernels):"
	@echo "  python3 bench/run.py --list; python3 bench/run.py PLAN --dry-run prints a plan's commands"

clean:
	rm -rf demo-workspace .pytest_cache
