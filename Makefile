# Two commands on a fresh machine with Python 3.11+:  make test   and   make demo
# Both create .venv and install what they need; both can be run again at any time.

PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& { command -v $$p; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-matrix demo lint typecheck docs bench clean install browser zookeeper mariadb fuzz

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "Python 3.11+ is needed (python3.11, 3.12 or 3.13 on PATH)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstall when pyproject.toml changes.
$(STAMP): pyproject.toml | $(BIN)/python
	@echo "Installing distlocks and its development tools into $(VENV) (a minute or two the first time)..."
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# The demo needs less than the test suite (no linters, type checker, browser driver,
# docs or plotting); a venv that has the dev extra already has all of it.
DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then touch $(DEMO_STAMP); else \
		echo "Installing distlocks and what the demo needs into $(VENV) (about a minute the first time)..."; \
		$(BIN)/python -m pip install --quiet -e '.[demo]' && touch $(DEMO_STAMP); fi

install: $(STAMP)

# The browser test drives Debian's Chromium. Installed here only as root with apt-get
# and only if missing; a failure is not fatal (the test then skips, saying why).
browser:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing chromium (apt-get) for the browser test..."; \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 \
		  || { apt-get update -qq >/dev/null 2>&1 \
		       && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; }; } \
		|| echo "Could not install chromium: the browser test will be skipped."; \
	fi

# The ZooKeeper tests run Debian's ZooKeeper jars on a headless JRE: installed here only
# as root with apt-get and only if missing; a failure is not fatal (the tests then skip,
# saying what to install).
zookeeper:
	@if [ ! -e /usr/share/java/zookeeper.jar ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing ZooKeeper (apt-get) for the ZooKeeper tests..."; \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libzookeeper-java default-jre-headless >/dev/null 2>&1 \
		  || { apt-get update -qq >/dev/null 2>&1 \
		       && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libzookeeper-java default-jre-headless >/dev/null 2>&1; }; } \
		|| echo "Could not install ZooKeeper: the ZooKeeper tests will be skipped."; \
	fi

# The MySQL/MariaDB fencing tests run Debian's MariaDB server (started by the tests in a
# temporary directory): installed here only as root with apt-get and only if missing; a
# failure is not fatal (the tests then skip, saying what to install).
mariadb:
	@if [ ! -x /usr/sbin/mariadbd ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing mariadb-server (apt-get) for the MariaDB fencing tests..."; \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mariadb-server >/dev/null 2>&1 \
		  || { apt-get update -qq >/dev/null 2>&1 \
		       && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mariadb-server >/dev/null 2>&1; }; } \
		|| echo "Could not install mariadb-server: the MariaDB fencing tests will be skipped."; \
	fi

# Two pytest-xdist workers, each with servers of its own (tests/settings.py), test files
# shared out whole; PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
test: $(STAMP) browser zookeeper mariadb
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The suite on every supported Django and Python: the quick run above (Django 5.2),
# then Django 6.x on Python 3.12 and 3.13, each in its own venv under .venv-matrix/
# (an interpreter not on the machine is skipped with a message). MATRIX lists the
# python:django pairs.
MATRIX ?= 3.12:6 3.13:6
test-matrix: test
	bash .ci/matrix $(MATRIX)

# The stateful and property tests of tests/stateful, with many more and longer runs than
# `make test` gives them, and the example database (.hypothesis/) so that a failure
# found once is tried first the next time. FUZZ_ARGS adds pytest arguments.
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest tests/stateful $(FUZZ_ARGS)

demo: $(DEMO_STAMP)
	@echo "Starting the demo: throwaway Redis, PostgreSQL and etcd, then the site, a Celery worker and two beats..."
	$(BIN)/python -m demo_project.run

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy distlocks

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .venv-matrix site .pytest_cache .mypy_cache .ruff_cache .hypothesis
