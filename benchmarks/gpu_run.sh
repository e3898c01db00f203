#!/usr/bin/env bash
# One GPU-machine session: install, GPU tests, kernel tuning sweep, benchmarks, compiled code.
# Writes everything under $OUT (default ./gpu-out). Liger-Kernel is used when importable.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | tail -1
python3 -m pytest -q tests 2>&1 | tail -25
[ "${TUNE:-1}" = 1 ] && python3 benchmarks/tune_xent.py > "$OUT/tune.jsonl"
fastlm bench xent --out "$OUT/bench"
fastlm inspect compiled-xent --output "$OUT/compiled_xent.py"
