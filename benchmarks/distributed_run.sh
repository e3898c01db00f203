#!/usr/bin/env bash
# GPU-machine run for data parallelism (2 or more GPUs, one call): NCCL all-reduce sweep, the
# data-parallel step benchmark of the xl preset (every variant, then the optimizer-state memory
# rows), and torchrun smoke runs of the training entry point (bucketed DDP, sharded optimizer, FSDP).
# PROCS (default: 2 and, on 4 GPUs, 4). Records and reports land in $OUT/distributed_out.tar.gz,
# the Chrome traces in $OUT/distributed_traces_{1,2}.tar.
set -uo pipefail
OUT=${OUT:-gpu-out}
WORK=/tmp/fastlm-distributed
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
nvidia-smi -L
nvidia-smi topo -m | head -8
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | tail -1
GPUS=$(nvidia-smi -L | wc -l)
PROCS=${PROCS:-$([ "$GPUS" -ge 4 ] && echo 2,4 || echo 2)}
pack() {
  tar -czf "$OUT/distributed_out.tar.gz" -C "$WORK" results reports
  # the traces in two archives, each under the 16 MB a returned file may have
  if [ -d "$WORK/traces" ]; then
    (cd "$WORK" && ls traces/*.json.gz | sort > traces.list)
    half=$(( ($(wc -l < "$WORK/traces.list") + 1) / 2 ))
    (cd "$WORK" && head -n "$half" traces.list | tar -cf "$OUT/distributed_traces_1.tar" -T -)
    (cd "$WORK" && tail -n +"$((half + 1))" traces.list | tar -cf "$OUT/distributed_traces_2.tar" -T -)
  fi
}
fastlm bench allreduce --procs "$PROCS" --iters 20 --out "$WORK" 2>&1 | tail -20
pack
fastlm bench ddp --procs "$PROCS" --steps 20 --out "$WORK" 2>&1 | tail -45
pack
for mode in "--parallel bucketed --bucket-mb 25" "--parallel torch-ddp --shard-optimizer" "--parallel fsdp"; do
  echo "== torchrun -m fastlm.train --preset small $mode"
  torchrun --nproc-per-node 2 -m fastlm.train --preset small --precision bf16 --steps 20 $mode 2>&1 | grep -E "step 20/20|Error|error" | tail -3
done
ls -la "$OUT"
