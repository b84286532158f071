# Two set-up commands: `make demo` and `make test` (see README.md).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install chromium demo test services layout bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip wheel
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP) chromium

# The console's browser tests drive Debian's Chromium (never a browser Playwright downloads).
CHROMIUM_HINT := Chromium is missing (/usr/bin/chromium): the console browser tests (tests/console) need it. Install it with 'sudo apt-get install -y chromium', or point DARKBLOOM_TEST_CHROMIUM at a Chromium binary.
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || echo "$(CHROMIUM_HINT)"; \
	elif command -v sudo >/dev/null 2>&1; then \
		sudo apt-get install -y chromium || { sudo apt-get update && sudo apt-get install -y chromium; } || echo "$(CHROMIUM_HINT)"; \
	else echo "$(CHROMIUM_HINT)"; fi

demo: $(STAMP)
	$(VENV)/bin/darkbloom demo

services:
	bash scripts/ensure_services.sh

# docs/architecture.md's rules: no import cycle, no module over 300 lines, no test hook in src/
layout:
	$(PY) scripts/check_layout.py

test: install services layout
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: install
	$(PY) bench/relay_overhead.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
