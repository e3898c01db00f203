#!/usr/bin/env bash
# GPU-machine run for the memory-bound kernels (one call): their GPU tests, `fastlm bench norms |
# softmax | conv1d | xent` in one results folder (one copy-bandwidth ceiling per benchmark), then
# the roofline that places them all. Liger-Kernel is compared where importable (install its wheel
# first). Records, reports and plots land in $OUT/kernels_out.tar.gz. TESTS=0 skips the GPU tests
# (when a call before this one ran them).
set -uo pipefail
OUT=${OUT:-gpu-out}
WORK=/tmp/fastlm-kernels
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | tail -1
[ "${TESTS:-1}" = 0 ] || python3 -m pytest -q -rf -p no:logging tests/ops/test_layer_norm.py \
  tests/ops/test_masked_softmax.py tests/ops/test_causal_conv1d.py tests/bench/test_harness.py 2>&1 | \
  grep -v "^DEBUG" | tee "$OUT/kernel_tests.log" | tail -15
pack() { tar -czf "$OUT/kernels_out.tar.gz" -C "$WORK" results reports; }
for op in norms softmax conv1d xent; do
  fastlm bench "$op" --out "$WORK" 2>&1 | grep -E "^\|" | grep -E "fastlm|liger|compile|eager" | cut -c1-200
  pack
done
fastlm bench roofline --out "$WORK" 2>&1 | tail -25
pack
