# Two set-up commands: `make demo` and `make test` (see README.md); `make check` is the fast lane.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# Bytecode is cached: with PYTHONDONTWRITEBYTECODE set (as on some CI images) every process a test
# starts would compile darkbloom again (0.7 s each) and every worker rewrite every test module
unexport PYTHONDONTWRITEBYTECODE
# pytest-xdist: every test module (or group of modules sharing a resource, tests/conftest.py) runs
# whole on one worker; most tests wait on processes, so more workers than cores pays
WORKERS ?= 4
XDIST   := -n $(WORKERS) --dist loadscope

.PHONY: install chromium tshark wrk node-clients demo test check services layout typecheck screenshots bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip wheel
	@echo "Installing darkbloom and its test/bench extras into $(VENV) (the test extra brings the node's"
	@echo "llama.cpp and MLX extras: MLX's CPU build off macOS, so the MLX tests run here). On a fresh machine pip compiles"
	@echo "llama-cpp-python from source: about 14 minutes on 2 cores with no output while it builds (pip"
	@echo "caches the wheel, so later installs take seconds). Progress lines follow."
	$(PY) -m pip install --progress-bar on -e '.[node,test,bench]'
	touch $(STAMP)

install: $(STAMP) chromium tshark wrk node-clients

# $(call apt_install,package,hint): install a Debian package when its command is missing (apt-get as
# root, sudo otherwise, the hint when neither works); noninteractive answers debconf with defaults.
define apt_install
	@if command -v $(1) >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "Installing $(1) (apt-get)…"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1) || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1); } || echo "$(2)"; \
	elif command -v sudo >/dev/null 2>&1; then \
		echo "Installing $(1) (sudo apt-get)…"; \
		sudo DEBIAN_FRONTEND=noninteractive apt-get install -y $(1) || { sudo apt-get update && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y $(1); } || echo "$(2)"; \
	else echo "$(2)"; fi
endef

# The console's browser tests drive Debian's Chromium (never a browser Playwright downloads).
CHROMIUM_HINT := Chromium is missing (/usr/bin/chromium): the console browser tests (tests/console) need it. Install it with 'sudo apt-get install -y chromium', or point DARKBLOOM_TEST_CHROMIUM at a Chromium binary.
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || echo "$(CHROMIUM_HINT)"; \
	elif command -v sudo >/dev/null 2>&1; then \
		sudo apt-get install -y chromium || { sudo apt-get update && sudo apt-get install -y chromium; } || echo "$(CHROMIUM_HINT)"; \
	else echo "$(CHROMIUM_HINT)"; fi

# tests/reliability/test_capture.py captures the coordinator's port on loopback with Debian's tshark;
# noninteractive answers wireshark-common's debconf question (setuid dumpcap) with its default, no.
TSHARK_HINT := tshark is missing (/usr/bin/tshark): the capture test (tests/reliability/test_capture.py) skips without it. Install it with 'sudo DEBIAN_FRONTEND=noninteractive apt-get install -y tshark' (capturing needs root or CAP_NET_RAW).
tshark:
	$(call apt_install,tshark,$(TSHARK_HINT))

# tests/clients drives openai-node and the Vercel AI SDK with Node.js (Debian's nodejs, via its npm
# package, when missing): `npm ci` from the committed lockfile whenever node_modules is missing or
# older than the lockfile; the stamp is the copy of the lockfile npm ci writes into node_modules.
NODE_CLIENTS := tests/clients/node
NODE_STAMP   := $(NODE_CLIENTS)/node_modules/.package-lock.json
NODE_HINT := npm is missing: tests/clients (openai-node, the Vercel AI SDK) needs Node.js 18 or later. Install it with 'sudo apt-get install -y nodejs npm', then run 'make node-clients'.
node-clients: $(NODE_STAMP)

$(NODE_STAMP): $(NODE_CLIENTS)/package-lock.json $(NODE_CLIENTS)/package.json
	$(call apt_install,npm,$(NODE_HINT))
	@if command -v npm >/dev/null 2>&1; then \
		echo "Installing openai-node and the Vercel AI SDK for tests/clients: npm ci in $(NODE_CLIENTS) (from its lockfile, a few seconds)…"; \
		cd $(NODE_CLIENTS) && npm ci --no-audit --no-fund && touch node_modules/.package-lock.json; \
	fi

demo: $(STAMP)
	$(VENV)/bin/darkbloom demo

services:
	bash scripts/ensure_services.sh

# docs/architecture.md's rules: no import cycle, no module over 600 lines (a warning), no test hook in src/
layout:
	$(PY) scripts/check_layout.py

# mypy --strict on the packages pyproject.toml's [tool.mypy] names
typecheck:
	$(PY) -m mypy

# The fast lane while developing: layout, types and every test not marked e2e, on an installed .venv
# (no installs: `make test` once first)
check: services layout typecheck
	$(PY) -m pytest -q -m "not e2e" $(XDIST) $(PYTEST_ARGS)

test: install services layout typecheck
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)
	@# docs/compatibility.md from this run's tests/clients results (absent when PYTEST_ARGS left them out)
	@if [ -f tests/clients/.results.json ]; then $(PY) scripts/compatibility_table.py; fi

# docs/img/: the console's screenshots, taken by tests/console/test_console_flow.py,
# test_console_machines.py (a machine serving other weights than the catalog pins),
# test_console_sharing.py (the Sharing page, and the chat on Shared machines),
# test_console_insight.py (a machine's last 24 h, usage per day) and test_console_batches.py (batches)
screenshots: install services
	DARKBLOOM_SCREENSHOTS=$(CURDIR)/docs/img $(PY) -m pytest -q tests/console/test_console_flow.py \
		tests/console/test_console_machines.py tests/console/test_console_sharing.py \
		tests/console/test_console_insight.py tests/console/test_console_batches.py

# bench/relay_overhead.py drives every path with Debian's wrk (a Python load generator saturates
# long before the relay does); py-spy, for its profiles, comes from the bench extra (pip).
WRK_HINT := wrk is missing (/usr/bin/wrk): bench/relay_overhead.py needs it. Install it with 'sudo apt-get install -y wrk'.
wrk:
	$(call apt_install,wrk,$(WRK_HINT))

BENCH_ARGS ?=
bench: $(STAMP) wrk
	@echo "Running bench/relay_overhead.py: upstream, coordinator and node on 127.0.0.1, wrk on every path (several minutes)…"
	$(PY) bench/relay_overhead.py $(BENCH_ARGS)

# bench/replicas.py: three replicas on Postgres + Redis + NATS (make services), HAProxy from Debian in front
HAPROXY_HINT := haproxy is missing (/usr/sbin/haproxy): bench/replicas.py needs it. Install it with 'sudo apt-get install -y haproxy'.
.PHONY: bench-replicas
bench-replicas: $(STAMP) wrk services
	$(call apt_install,haproxy,$(HAPROXY_HINT))
	@echo "Running bench/replicas.py: three replicas, HAProxy, nodes and wrk on 127.0.0.1 (about 4 minutes)…"
	$(PY) bench/replicas.py $(BENCH_ARGS)

# LiteLLM's proxy beside the relay (bench/relay_floor.py): its own virtualenv, since its proxy extra pins
# uvicorn and websockets below the versions darkbloom runs on (1.108.7: the newest release whose
# proxy extra installs from PyPI)
LITELLM_VENV := .venv-litellm
.PHONY: bench-litellm bench-floor
bench-litellm: $(LITELLM_VENV)/bin/litellm
$(LITELLM_VENV)/bin/litellm:
	@echo "Installing LiteLLM's proxy into $(LITELLM_VENV) (a minute or two)…"
	test -x $(LITELLM_VENV)/bin/python || python3 -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/python -m pip install -q 'litellm[proxy]==1.108.7'

bench-floor: $(STAMP) wrk bench-litellm
	@echo "Running bench/relay_floor.py: direct, the bare floor, self-route, paid and LiteLLM at c=1 (about 3 minutes)…"
	$(PY) bench/relay_floor.py $(BENCH_ARGS)

# bench/node_engine.py: the node's engine beside llama.cpp's own llama-server, built on first use from
# the llama.cpp in the installed llama-cpp-python's sdist into ~/.cache/darkbloom-bench (bench only)
.PHONY: bench-node
bench-node: $(STAMP)
	@v=$$($(PY) -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))"); \
	test -x "$${XDG_CACHE_HOME:-$$HOME/.cache}/darkbloom-bench/llama-server-$$v/build/bin/llama-server" || \
	echo "First run with llama-cpp-python $$v: downloading its sdist and building llama-server with CMake (about 7 minutes on 2 cores; cached in ~/.cache/darkbloom-bench)…"
	@echo "Running bench/node_engine.py: the node, then llama-server, at C=1,2,4,8 on the bundled model (about 8 minutes)…"
	$(PY) bench/node_engine.py $(BENCH_ARGS)

# bench/mlx_engine.py: the node's MLX backend (MLX's CPU build) beside its llama.cpp backend on the bundled
# model; the MLX copy is converted once into ~/.cache/darkbloom-tests (as the tests convert it)
.PHONY: bench-mlx
bench-mlx: $(STAMP)
	@echo "Running bench/mlx_engine.py: the node on llama.cpp, then on MLX, at C=1,4 on the bundled model (about 8 minutes)…"
	$(PY) bench/mlx_engine.py $(BENCH_ARGS)

# bench/conversation_turns.py: a conversation's second turn through the coordinator beside direct mode
.PHONY: bench-turns
bench-turns: $(STAMP)
	@echo "Running bench/conversation_turns.py: a coordinator and three nodes, direct vs Self-Route vs public (about 3 minutes)…"
	$(PY) bench/conversation_turns.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(LITELLM_VENV) build src/*.egg-info .pytest_cache
