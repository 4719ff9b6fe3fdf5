# Two commands for a newcomer: `make test` and `make demo`. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A plain `torch` pin: on a CPU machine with a local wheel cache this picks the CPU build,
# elsewhere PyPI's default (CUDA) build. Override with `make TORCH=... test`.
TORCH ?= torch==2.13.0

.PHONY: setup test test-gpu demo lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q

test-gpu: setup
	$(PY) -m pytest -q -m gpu

demo: setup
	$(VENV)/bin/batchinfer demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info demo-output
