#!/usr/bin/env bash
# GPU-machine runs for the language model (one PART per call, each well under 10 minutes):
#   PART=check   model GPU tests, a few bench rows (eager/compile, torch/fastlm kernels, HF Llama),
#                profile of the small preset, memory of 2.7b
#   PART=sweep   PRESETS=... the bench sweep for those presets (all modes, precisions, eager/compile)
# Records, reports and plots are packed into $OUT/model_out.tar.gz (bulky traces and snapshots
# stay on the machine; their sizes are listed).
set -uo pipefail
OUT=${OUT:-gpu-out}
WORK=/tmp/fastlm-model
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | tail -1
case "${PART:-check}" in
check)
  python3 -m pytest -q tests/model 2>&1 | tail -5
  fastlm bench model --preset small --mode train --precision bf16 --compile eager,compile \
    --kernels torch,fastlm --hf --out "$WORK" 2>&1 | tail -20
  fastlm profile model --preset small --out "$WORK" 2>&1 | head -30
  fastlm profile memory --out "$WORK" 2>&1 | tail -25
  ;;
sweep)
  fastlm bench model --sweep --preset "${PRESETS}" --kernels "${KERNELS:-torch}" --out "$WORK" 2>&1 | tail -40
  ;;
esac
ls -la "$WORK"/traces "$WORK"/snapshots 2>/dev/null
tar -czf "$OUT/model_out.tar.gz" -C "$WORK" results reports
