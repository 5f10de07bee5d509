#!/usr/bin/env bash
# The prepared GPU check (tools/gpu_check.py), as it runs on a lent GPU machine with only torch:
# kvport from this checkout's src/, results into $OUT (or ./gpu-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 480 python3 tools/gpu_check.py --out "${OUT:-gpu-check-out}" "$@"
