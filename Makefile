# One entry point for people and CI. Every target creates .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The service alone (what `make demo` needs); STAMP adds the dev tools on top.
STAMP_BASE := $(VENV)/.installed-base
PIP := $(VENV)/bin/pip --disable-pip-version-check
# pipefail: pip's progress is filtered through grep, and pip's failure must still fail.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PG_ADMIN_URL ?= postgresql://postgres@127.0.0.1:5432/postgres
PYTEST_ARGS ?=

# PostgreSQL tests run wherever the local server answers (CI fails without it).
PG_URL := $(shell pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null && echo $(PG_ADMIN_URL))
export OUTBOX_TEST_POSTGRES_URL ?= $(PG_URL)

.PHONY: help venv demo example test lint docs docs-check docs-serve fmt browser pgbouncer run chaos chaos-quick chaos-failover chaos-pooler bench bench-quick bench-drain bench-rss bench-flood bench-slow bench-storage bench-contention profile clean

help:
	@echo "make demo        the end-to-end story on a fresh SQLite file"
	@echo "make example     an app of its own (examples/refunds) run by the stock processes"
	@echo "make test        lint, types, import layers and every test (PostgreSQL when it answers)"
	@echo "make run         API, dispatcher, reconciler and a fake provider on this machine"
	@echo "make chaos       crash/fault run with invariant checks (bounded)"
	@echo "make chaos-quick a short chaos run (600 calls, 6 kills per database, bounded by count)"
	@echo "make docs        build the documentation site into site/ (mkdocs --strict)"
	@echo "make chaos-failover  kill -9 a PostgreSQL primary under load, promote its replica"
	@echo "make chaos-pooler    the chaos run through PgBouncer in transaction pooling mode"
	@echo "make bench       performance figures as ratios to same-run baselines (bounded)"
	@echo "make bench-drain / bench-flood / bench-slow  lost replies drained, a flooding tenant, a slow provider"
	@echo "make bench-storage  the outbox tables' writes with and without their fillfactors (PostgreSQL)"
	@echo "make bench-rss   a dispatcher's memory over a million effects (at most 10% growth)"
	@echo "make bench-contention  a four-client create's extra CPU: more work, or the same work costing more"

$(VENV)/bin/python:
	@echo "==> creating the virtual environment $(VENV) ($$(python3 -V))"
	python3 -m venv $(VENV)
	@echo "==> updating pip"
	$(PIP) install -q -U pip

$(STAMP_BASE): pyproject.toml | $(VENV)/bin/python
	@echo "==> installing Outbox and its dependencies into $(VENV) (about a minute on a fresh machine)..."
	$(PIP) install --progress-bar on -e . | { grep -v '^Requirement already satisfied' || true; }
	@touch $(STAMP_BASE)

$(STAMP): pyproject.toml | $(VENV)/bin/python
	@echo "==> installing Outbox with its development tools into $(VENV) (about 2 minutes on a fresh machine)..."
	$(PIP) install --progress-bar on -e '.[dev]' | { grep -v '^Requirement already satisfied' || true; }
	@touch $(STAMP) $(STAMP_BASE)

venv: $(STAMP)

demo: $(STAMP_BASE)
	@echo "==> running the demo: real processes on 127.0.0.1, a fresh SQLite file"
	$(PY) examples/demo.py

example: $(STAMP)
	$(PY) examples/refunds/run.py

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The documentation site; --strict turns a broken link or a page missing from
# the nav into an error. Built into a throwaway directory by `make test`.
DOCS_DIR ?= site
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $(DOCS_DIR)

docs-serve: $(STAMP)
	$(VENV)/bin/mkdocs serve

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

# The site must build with --strict (a broken link or anchor, a page left out of the
# nav); built into a temporary directory, removed after. Not --quiet: it drops the
# warnings before --strict counts them, and the build then passes a broken link. The
# INFO lines are filtered instead (pipefail keeps mkdocs's exit status).
docs-check: $(STAMP)
	@tmp=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $$tmp/site 2>&1 | { grep -v '^INFO ' || true; }; rc=$$?; rm -rf $$tmp; exit $$rc

test: $(STAMP) lint docs-check browser
	@if [ -z "$$OUTBOX_TEST_POSTGRES_URL" ]; then echo "PostgreSQL does not answer on 127.0.0.1:5432: its tests will be skipped (CI fails instead)"; fi
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

run: $(STAMP)
	$(VENV)/bin/outbox dev

chaos: $(STAMP)
	$(PY) -m bench.chaos $(CHAOS_ARGS)

# A few minutes at most: every call made and every kill landed, whatever the
# machine's speed (no time bound), on PostgreSQL too when it answers.
chaos-quick: $(STAMP)
	$(PY) -m bench.chaos --db $(if $(PG_URL),both,sqlite) --operations 600 --kills 6 --max-seconds 0 $(CHAOS_ARGS)

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

# Lost replies that drain in seconds: the figure, then the same case as a test.
bench-drain: $(STAMP)
	$(PY) -m bench.drain $(DRAIN_ARGS)
	$(PY) -m pytest -q -p no:cacheprovider bench/drain

# A dispatcher's memory over the issue's million effects (at most 10% growth): the
# backlog is made in under a minute, the drain takes 1 to 5 minutes, 25 at the most.
bench-rss: $(STAMP)
	$(PY) -m bench.perf.rss $(RSS_ARGS)

# Where the hot loops spend their time: py-spy flame graphs of the dispatch and create
# loops on PostgreSQL (docs/performance.md, "Profiles"). About a minute.
profile: $(STAMP)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev,bench]'
	$(VENV)/bin/py-spy record --idle --rate 250 --format flamegraph -o docs/images/profile-dispatch.svg -- $(PY) -m bench.profile dispatch
	$(VENV)/bin/py-spy record --idle --rate 250 --format flamegraph -o docs/images/profile-create.svg -- $(PY) -m bench.profile create

# A provider that takes seconds per request beside a fast one: the fast one's latency with
# the slow-send handling on and off, against the fast one alone (about a minute).
bench-slow: $(STAMP)
	$(PY) -m bench.slow $(SLOW_ARGS)

# What a delivery's writes cost PostgreSQL with the tables' fillfactors and without:
# WAL, HOT updates, sizes, and EXPLAIN (ANALYZE, BUFFERS, WAL) of the claim and the result.
bench-storage: $(STAMP)
	$(PY) -m bench.storage $(STORAGE_ARGS)

# Whether a four-client create's extra CPU is more work or the same work costing more:
# calls a create makes and a fixed canary's CPU, 1 and 4 clients (about two minutes).
bench-contention: $(STAMP)
	$(PY) -m bench.contention $(CONTENTION_ARGS)

# One tenant floods, another's p99 is measured unloaded and under the flood (at most 3x).
# A latency ratio on a shared 2-core box: a measurement, so it lives here, not in make test.
bench-flood: $(STAMP)
	$(PY) -m pytest -q -s -p no:cacheprovider bench/flood

clean:
	rm -rf $(VENV) var site .mypy_cache .ruff_cache .pytest_cache
