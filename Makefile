PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q tests

demo: install
	$(BIN)/kvroute sim --workload sessions --replicas 8 --policy all

bench: install
	$(BIN)/python -m bench.micro

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
