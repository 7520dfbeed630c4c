#!/usr/bin/env bash
# The GPU benchmark in one command, on a CUDA machine with this repo installed (`make install`):
#
#     bash benchmarks/gpu.sh
#
# ddptrain vs the raw DDP loop on every visible GPU with AMP bf16 (+ channels_last, + torch.compile), for
# two MiniResNets (images/s) and a GPT (tokens/s), with MFU and peak memory; the CUDA hot-path test (needs
# pytest: `make install`); DataParallel vs DDP with >= 2 GPUs. Within 8 minutes (benchmarks/gpu.py); writes
# its JSON and a section at the top of benchmarks/RESULTS.md. Without CUDA it stops at once with a message
# saying so (exit 2); `--cpu_dry_run` runs its code path on 2 CPU processes at toy size.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --signal=TERM --kill-after=15 480 "$PY" -m benchmarks.gpu "$@"
