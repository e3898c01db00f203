#!/usr/bin/env bash
# Run book of a model that fits only sharded (a 4-GPU machine): the 10b preset (12.7B parameters,
# 204 GB of fp32 weights, gradients and AdamW state) under --parallel fsdp with --recompute on
# PROCS GPUs (default 4), MICRO windows of CONTEXT tokens per GPU (default 6 of 2048), for STEPS
# steps (default 200), then the same model under --parallel ddp,
# which must stop at once with a one-line error that names fsdp. Data: train_run.sh
# PART=data in $WORK first. Records (tokens/s, MFU, peak memory per GPU) and the table land in $OUT.
set -uo pipefail
WORK=${WORK:-/tmp/fastlm-train}
OUT=${OUT:-gpu-out}
PROCS=${PROCS:-4} PRESET=${PRESET:-10b} CONTEXT=${CONTEXT:-2048} MICRO=${MICRO:-6}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
COMMON=(--data "$WORK/data" --preset "$PRESET" --context "$CONTEXT" --micro-batch "$MICRO" --checkpoint-every 0
        --eval-every 0 --eval-sequences $((MICRO * PROCS)) --no-documents --kernels "${KERNELS:-torch}")
torchrun --nproc-per-node "$PROCS" -m fastlm.train "${COMMON[@]}" --parallel fsdp --recompute \
  --steps "${STEPS:-200}" --warmup 20 --log-every 10 --out "$WORK/sharded-fsdp" 2>&1 \
  | grep -v "^W.*torch/distributed/run.py" | tee "$OUT/sharded_fsdp.log" | tail -3
python3 benchmarks/train_records.py "$WORK/sharded-fsdp" --results "$OUT/train.jsonl" | tee "$OUT/sharded.md"
fastlm analyze memory --preset "$PRESET" --context "$CONTEXT" --micro-batch "$MICRO" --vocab 320 --parallel fsdp \
  --gpus "$PROCS" --recompute --kernels "${KERNELS:-torch}" | tee -a "$OUT/sharded.md"
timeout 300 torchrun --nproc-per-node "$PROCS" -m fastlm.train "${COMMON[@]}" --parallel ddp --steps 2 \
  --out "$WORK/sharded-ddp" 2>&1 | grep "error:" | sort -u | tee -a "$OUT/sharded.md" \
  || echo "ddp: no error line (a run that fits, or stopped by the 300 s timeout)" | tee -a "$OUT/sharded.md"
