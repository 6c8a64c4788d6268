#!/usr/bin/env bash
# Smoke-tests a built ditserve image: its entry points start, its torch is the pinned CUDA
# build, and on a GPU node (`--gpus all`) the tiny Flux and Wan models generate end to end.
#   docker build -t ghcr.io/ditserve/ditserve:0.1.0 .
#   bash scripts/smoke-image.sh ghcr.io/ditserve/ditserve:0.1.0 [--cpu]
set -euo pipefail
IMAGE=${1:?usage: smoke-image.sh IMAGE [--cpu]}
PINNED=$(sed -n 's/^torch==//p' "$(dirname "$0")/../requirements.txt")
run() { docker run --rm "$@"; }

echo "[smoke] entry points and torch $PINNED"
run "$IMAGE" sh -c "ditserve --help >/dev/null && cachectl --help >/dev/null \
  && ditserve-operator --help >/dev/null \
  && python -c \"import torch, sys; v = torch.__version__.split('+')[0]; \
print('torch', v, 'cuda', torch.version.cuda); sys.exit(v != '$PINNED' or not torch.version.cuda)\""

if [ "${2:-}" = "--cpu" ]; then
  GPU=(); DEVICE=cpu
else
  GPU=(--gpus all); DEVICE=cuda
fi
echo "[smoke] demo and a Wan video on $DEVICE"
run "${GPU[@]}" "$IMAGE" sh -c "cd /tmp && ditserve demo --device $DEVICE --out-dir demo \
  && ditserve model init-tiny --family wan tiny-wan \
  && ditserve generate --model tiny-wan --prompt waves --device $DEVICE --out waves.mp4 \
  && test -s waves.mp4"
echo "[smoke] ok"
