#!/usr/bin/env bash
# The GPU check in one command; the logic and --help are in benchmarks/gpu_check.py.
#     bash benchmarks/gpu_check.sh --out "$OUT"        # on a GPU machine (carry benchmarks/gpu_wheels)
#     bash benchmarks/gpu_check.sh --cpu-dry-run --out DIR
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
