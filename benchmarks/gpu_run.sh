#!/usr/bin/env bash
# One GPU-machine session: install, GPU tests, kernel tuning sweeps, benchmarks, compiled code.
# All of it takes longer than one 10-minute run: TUNE=0 skips the sweeps.
# Writes everything under $OUT (default ./gpu-out). Liger-Kernel is used when importable.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | tail -1
python3 -m pytest -q tests 2>&1 | tail -25
[ "${TUNE:-1}" = 1 ] && python3 benchmarks/tune_xent.py > "$OUT/tune.jsonl"
[ "${TUNE:-1}" = 1 ] && python3 benchmarks/tune_attention.py > "$OUT/tune_attention.jsonl"
fastlm bench xent --out "$OUT/bench"
fastlm bench attention --sweep model,flash,naive,compile --out "$OUT/bench"
fastlm bench norms --out "$OUT/bench"
fastlm inspect compiled-xent --output "$OUT/compiled_xent.py"
fastlm bench host --compile eager,compile --out "$OUT/bench"
