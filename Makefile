# The README's two commands: `make demo` and `make test`. Both set up .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test lint unit bench clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/cpn demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy .

unit: install
	$(PY) -m pytest -m "not slow"

test: lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache cpn.egg-info
