# Two set-up commands: `make demo` and `make test` (see README.md).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install demo test services bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip wheel
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/darkbloom demo

services:
	bash scripts/ensure_services.sh

test: install services
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: install
	$(PY) bench/relay_overhead.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
