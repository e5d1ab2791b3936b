# The README's two commands: `make demo` and `make test`. Both set up .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install tools browser demo test lint unit bench compile docs clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

# checkov (tests/helm/test_checkov.py scans the rendered chart with it) pins packaging<24,
# which constraints.txt excludes, so it gets a virtual environment of its own.
CHECKOV_VENV := $(VENV)/tools/checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-stamp

$(CHECKOV_STAMP): tests/helm/checkov-requirements.txt
	@test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CHECKOV_VENV)/bin/python -m pip install --quiet -r tests/helm/checkov-requirements.txt
	@touch $(CHECKOV_STAMP)

# promtool (tests/service/test_metrics.py lints /metrics with it) comes with Debian's prometheus;
# `dot` (the docs site draws its state diagrams with it) with Debian's graphviz.
tools: $(CHECKOV_STAMP)
	@command -v promtool >/dev/null || (apt-get update && apt-get install -y --no-install-recommends prometheus)
	@command -v dot >/dev/null || (apt-get update && apt-get install -y --no-install-recommends graphviz)

# The web console's browser tests (tests/ui) drive Debian's chromium through Playwright; no
# browser is ever downloaded (`playwright install` is never run).
browser:
	@command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)

demo: install
	$(VENV)/bin/cpn demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
	$(VENV)/bin/lint-imports

unit: install tools
	$(PY) -m pytest -m "not slow"

test: lint tools browser
	$(PY) -m pytest

# The quick benchmarks: tables on stdout in about a minute, nothing written. The others (they
# refresh the plots in bench/results/, some need PostgreSQL or root) are run by hand:
# docs/benchmarks/index.md.
bench: install
	$(PY) -m bench.scheduler --quick
	$(PY) -m bench.compressors

# The docs site in site/ (read it with `python3 -m http.server -d site`); built offline.
docs: install tools
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Optional: the scheduler's decision code compiled by mypyc (the same plans, ~1.7x faster), used
# only while the sources it was built from are unchanged (scheduler/native.py). Needs gcc.
compile: install
	$(PY) -c "from scheduler.native import build; print('compiled into', build())"

clean:
	rm -rf $(VENV) site .mypy_cache .pytest_cache .ruff_cache cpn.egg-info scheduler/_native scheduler/_native.new
