# `make demo`: set up .venv and run the quickstart (pFedHN on digits, CPU, a few minutes).
# `make test`: set up .venv if needed and run the test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint setup clean

$(BIN)/lightning-pfl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(BIN)/lightning-pfl

demo: setup
	$(BIN)/lightning-pfl fit --config configs/quickstart.yaml

# PYTHONDONTWRITEBYTECODE (set on some machines) would make every pytest worker and every
# Python the tests start compile lightning_pfl and rewrite the test modules anew; the suite
# caches them in __pycache__ (git-ignored) instead.
test: setup
	PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -n auto --dist worksteal tests

lint: setup
	$(BIN)/ruff check lightning_pfl tests benchmarks cli.py
	$(BIN)/ruff format --check lightning_pfl tests benchmarks cli.py
	$(BIN)/mypy

clean:
	rm -rf $(VENV) logs
