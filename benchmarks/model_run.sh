#!/usr/bin/env bash
# GPU-machine runs for the language model (one PART per call, each under 10 minutes):
#   PART=check    model GPU tests, a few bench rows, profile of small, memory of 2.7b
#   PART=sweep    PRESETS=a,b  the bench sweep (all modes, precisions, eager/compile) for those presets
#   PART=targets  xl and 2.7b training steps: bf16 + compile, torch vs fastlm kernels vs HF Llama,
#                 at BATCH (default 4)
#   PART=profile  the committed profile of small, and the memory table of 2.7b
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
  fastlm bench model --sweep --preset "${PRESETS}" --warmup 3 --out "$WORK" 2>&1 | tail -40
  ;;
targets)
  fastlm bench model --preset "${PRESETS:-xl,2.7b}" --batch "${BATCH:-4}" --mode train --precision bf16 \
    --compile compile --kernels torch,fastlm --hf --out "$WORK" 2>&1 | tail -20
  ;;
profile)
  fastlm profile model --preset small --out "$WORK" 2>&1 | tail -12
  fastlm profile memory --out "$WORK" 2>&1 | tail -22
  ;;
esac
ls -la "$WORK"/traces "$WORK"/snapshots 2>/dev/null
tar -czf "$OUT/model_out.tar.gz" -C "$WORK" results reports
