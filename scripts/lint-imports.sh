#!/usr/bin/env bash
# Runs import-linter on the layering contracts in pyproject.toml. import-linter reads packages
# from the filesystem and cannot follow setup.py's folder mapping (nor the editable install's
# import hook), so lay out a copy of the sources as the installed `ditserve` package would
# look, and run without site hooks (-S) from outside the repository root (whose `operator/`
# folder would otherwise shadow the standard library).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/build/lint-imports"
rm -rf "$OUT"; mkdir -p "$OUT/ditserve"
cp "$ROOT/ditserve/__init__.py" "$OUT/ditserve/"
for folder in engine cachectl operator; do
  cp -r "$ROOT/$folder" "$OUT/ditserve/$folder"
done
find "$OUT" -name __pycache__ -prune -exec rm -rf {} +
PY="$ROOT/.venv/bin/python"
# pyproject's contracts plus the ones the family folders imply (scripts/family_contracts.py).
CONFIG="$OUT/importlinter.toml"
LAYER="$("$PY" "$ROOT/scripts/family_contracts.py" "$ROOT" --pipelines-layer)"
LAYER="$LAYER" "$PY" - "$ROOT/pyproject.toml" "$CONFIG" <<'PYEOF'
import os, sys
marker = '"ditserve.engine.pipelines",  # + every family\'s torch-side modules (generated)'
text = open(sys.argv[1], encoding="utf-8").read()
assert marker in text, "pyproject.toml lost the pipelines layer's marker line"
text = text.replace(marker, '"' + os.environ["LAYER"] + '",')
open(sys.argv[2], "w", encoding="utf-8").write(text)
PYEOF
"$PY" "$ROOT/scripts/family_contracts.py" "$ROOT" >> "$CONFIG"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cd "$OUT"
PYTHONPATH="$OUT:$SITE" "$PY" -S -c '
import sys
from importlinter.cli import lint_imports_command
sys.argv = ["lint-imports", sys.argv[1]]
sys.exit(lint_imports_command())
' "$CONFIG"
