# One entry point for people and CI. Every target creates .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PG_ADMIN_URL ?= postgresql://postgres@127.0.0.1:5432/postgres
PYTEST_ARGS ?=

# PostgreSQL tests run wherever the local server answers (CI fails without it).
PG_URL := $(shell pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null && echo $(PG_ADMIN_URL))
export OUTBOX_TEST_POSTGRES_URL ?= $(PG_URL)

.PHONY: help venv demo test lint fmt browser pgbouncer run chaos chaos-quick chaos-failover chaos-pooler bench bench-quick clean

help:
	@echo "make demo        the end-to-end story on a fresh SQLite file"
	@echo "make test        lint, types, import layers and every test (PostgreSQL when it answers)"
	@echo "make run         API, dispatcher, reconciler and a fake provider on this machine"
	@echo "make chaos       crash/fault run with invariant checks (bounded)"
	@echo "make chaos-failover  kill -9 a PostgreSQL primary under load, promote its replica"
	@echo "make chaos-pooler    the chaos run through PgBouncer in transaction pooling mode"
	@echo "make bench       performance figures as ratios to same-run baselines (bounded)"

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -U pip
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The browser tests drive Debian's chromium; install it when missing and we may.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null; \
	  else echo "chromium is missing: install Debian's chromium package for the browser tests"; fi; \
	fi

test: $(STAMP) lint browser
	@if [ -z "$$OUTBOX_TEST_POSTGRES_URL" ]; then echo "PostgreSQL does not answer on 127.0.0.1:5432: its tests will be skipped (CI fails instead)"; fi
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

run: $(STAMP)
	$(VENV)/bin/outbox dev

chaos: $(STAMP)
	$(PY) -m bench.chaos $(CHAOS_ARGS)

# Both start their own servers on free loopback ports and stop by themselves:
# small, count-bounded runs (raise --operations / --max-seconds in CHAOS_ARGS).
chaos-failover: $(STAMP)
	$(PY) -m bench.chaos.scenarios failover --operations 150 --kills 2 --max-seconds 300 $(CHAOS_ARGS)

# PgBouncer is Debian's package; install it when missing and we may.
pgbouncer:
	@if [ ! -x /usr/sbin/pgbouncer ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer) >/dev/null; \
	  else echo "pgbouncer is missing: install Debian's pgbouncer package"; fi; \
	fi

chaos-pooler: $(STAMP) pgbouncer
	$(PY) -m bench.chaos.scenarios pooler --operations 150 --kills 2 --max-seconds 300 $(CHAOS_ARGS)

bench: $(STAMP)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev,bench]'
	$(PY) -m bench.perf $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev,bench]'
	$(PY) -m bench.perf --quick $(BENCH_ARGS)

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
