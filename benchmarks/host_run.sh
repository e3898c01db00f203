#!/usr/bin/env bash
# GPU-machine runs for the host path of the ops (one PART per call, each under 10 minutes):
#   PART=tests   the GPU tests of the ops and of the host benchmark (about 6.5 minutes on an H100)
#   PART=bench   one launch timed through Triton's dispatcher and fastlm's direct path, and the
#                backward's thread hop (benchmarks/profile_launch.py); `fastlm bench host` eager with
#                Triton's dispatcher (FASTLM_LAUNCH=triton), then eager and compiled with the direct
#                path; the compiled cases again with Inductor launching user-defined Triton kernels
#                through its static launcher (records under $OUT/static)
# Records and reports land under $OUT (results/, reports/), to be copied into benchmarks/. Where the
# tree was copied without an up-to-date .git, pass FASTLM_GIT_SHA=<sha> so the records name the code.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT/results" "$OUT/static"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | tail -1
case "${PART:-bench}" in
tests)
  python3 -m pytest -q -m gpu tests/ops tests/bench/test_host_bench.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
  ;;
bench)
  python3 benchmarks/profile_launch.py --out "$OUT/results"
  FASTLM_LAUNCH=triton fastlm bench host --out "$OUT" 2>&1 | tail -3
  fastlm bench host --compile eager,compile --out "$OUT" 2>&1 | tail -40
  TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1 \
    fastlm bench host --compile compile --out "$OUT/static" 2>&1 | tail -14
  ;;
esac
