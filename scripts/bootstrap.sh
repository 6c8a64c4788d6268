#!/usr/bin/env bash
# Creates .venv and installs ditserve with its pinned dependencies (CPU torch).
# Idempotent: a second run only re-checks the install. Used by `make demo`, `make test`, CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.ditserve-installed
if [ -f "$STAMP" ] && [ "$STAMP" -nt requirements.txt ] && [ "$STAMP" -nt requirements-dev.txt ] \
    && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt setup.py ]; then
  exit 0
fi
# The README's requirement (pyproject's requires-python): the code and tests use 3.11's stdlib.
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "[bootstrap] ditserve needs Python 3.11+; $PY is $("$PY" -V 2>&1)." >&2
  echo "[bootstrap] Run with PYTHON=python3.11 (or newer): PYTHON=python3.12 make demo" >&2
  exit 1
fi
echo "[bootstrap] creating .venv and installing dependencies (about 1-2 minutes on first run)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first and pinned: the CPU wheel. An unpinned torch would fetch a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0 uv
# uv is much faster than pip here; --compile-bytecode because imports stay slow without .pyc.
.venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode \
    -r requirements.txt -r requirements-dev.txt
.venv/bin/uv pip install -q --python .venv/bin/python --no-deps -e .
touch "$STAMP"
echo "[bootstrap] done"
