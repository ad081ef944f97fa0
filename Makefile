# X1 — the two commands that do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch for local runs and CI; the trainer image installs torch 2.11.0 (CUDA 13.0) itself.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.x1-installed
PYTEST_ARGS ?=

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
	$(PY) -m pytest $(PYTEST_ARGS)

test-docker: $(STAMP)
	$(PY) -m pytest tests/test_docker_engine_api.py tests/test_docker_compose.py tests/test_multinode.py $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m x1_pretrain.demo --workspace demo-workspace

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q tests/test_static_checks.py

bench-tokenize: $(STAMP)
	$(PY) bench/tokenize_throughput.py

# The GPU benchmark runs on a machine with a CUDA GPU, from the repo root, beside the plain
# reference (a copy of the reference script must be reachable as REFERENCE):
#   REFERENCE=path/to/reference_50m.py DATA=path/to/tokenized bash bench/gpu_run.sh
bench-gpu:
	@echo "On the GPU host, from the repo root:"
	@echo "  REFERENCE=path/to/reference_50m.py DATA=path/to/tokenized bash bench/gpu_run.sh"
	@echo "On a 2-GPU host, the scaling run (1 GPU, then DDP and FSDP2 on 2, then the reference):"
	@echo "  REFERENCE=path/to/reference_50m.py DATA=path/to/tokenized bash bench/device_scaling.sh"

clean:
	rm -rf demo-workspace .pytest_cache
