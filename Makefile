# The README's two commands: `make run` (the main job on the embedded default) and `make test`.
# Both create .venv and install the project into it on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup run test lint bench-throughput clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,ui]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/policyd bench

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q

bench-throughput: setup
	$(VENV)/bin/policyd bench-throughput

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
