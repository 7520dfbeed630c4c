#!/usr/bin/env bash
# The GPU benchmark in one command, on a CUDA machine with this repo installed (`make install`):
#
#     bash benchmarks/gpu.sh
#
# ddptrain vs the raw DDP loop on every visible GPU with AMP bf16 (+ channels_last, + torch.compile), for
# MiniResNet and a larger MiniResNet: images/s, MFU, peak memory. Within 8 minutes (benchmarks/gpu.py).
# Without CUDA it stops at once with a message saying so (exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --signal=TERM --kill-after=15 480 "$PY" -m benchmarks.gpu "$@"
