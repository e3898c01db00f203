#!/usr/bin/env bash
# GPU-machine run for the preference losses (one call): the GPU test of tests/test_losses.py, then
# `fastlm bench dpo` (eager, torch.compile, fastlm, and Liger's fused DPO where importable: install its
# wheel first). Records, report and plots land in $OUT/dpo_out.tar.gz. TESTS=0 skips the GPU test.
set -uo pipefail
OUT=${OUT:-gpu-out}
WORK=/tmp/fastlm-dpo
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | tail -1
[ "${TESTS:-1}" = 0 ] || python3 -m pytest -q -rf -p no:logging -m gpu tests/test_losses.py 2>&1 | \
  tee "$OUT/dpo_tests.log" | tail -5
fastlm bench dpo --out "$WORK" 2>&1 | grep -E "^\|" | cut -c1-200
tar -czf "$OUT/dpo_out.tar.gz" -C "$WORK" results reports
