#!/usr/bin/env bash
# GPU-machine run for data parallelism (2 or more GPUs, one call): NCCL all-reduce sweep, the
# data-parallel step benchmark of the xl preset (every variant, then the optimizer-state memory
# rows), and torchrun smoke runs of the training loop (bucketed DDP, sharded optimizer, FSDP) on the docs.
# PROCS (default: 2 and, on 4 GPUs, 4); ROUNDS of the step benchmark (default 2); PARTS (default
# "allreduce ddp train"). Records and reports land in $OUT/distributed_out.tar.gz, the Chrome traces
# in $OUT/distributed_traces_N.tar (each under the 16 MB a returned file may have).
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
  # the traces in archives of at most 15 MB each (at most 7 of them come back)
  [ -d "$WORK/traces" ] || return 0
  rm -f "$OUT"/distributed_traces_*.tar
  (cd "$WORK" && python3 - "$OUT" <<'PY'
import os, subprocess, sys
out, limit, groups = sys.argv[1], 15e6, [[]]
for name in sorted(os.listdir("traces")):
    path, size = f"traces/{name}", os.path.getsize(f"traces/{name}")
    if groups[-1] and sum(os.path.getsize(p) for p in groups[-1]) + size > limit:
        groups.append([])
    groups[-1].append(path)
for i, paths in enumerate(groups[:7], 1):
    subprocess.run(["tar", "-cf", f"{out}/distributed_traces_{i}.tar", *paths], check=True)
for paths in groups[7:]:
    print("traces left on the machine (more than 7 archives):", " ".join(paths))
PY
  )
}
PARTS=${PARTS:-allreduce ddp train}
if [[ $PARTS == *allreduce* ]]; then
  fastlm bench allreduce --procs "$PROCS" --iters 20 --out "$WORK" 2>&1 | tail -20
  pack
fi
if [[ $PARTS == *ddp* ]]; then
  fastlm bench ddp --procs "$PROCS" --steps 20 --rounds "${ROUNDS:-2}" --out "$WORK" 2>&1 | tail -45
  pack
fi
if [[ $PARTS == *train* ]]; then
  python3 -m fastlm.data prepare --input README.md docs --tokenizer bytes --out "$WORK/train-data" | tail -1
  for mode in "--parallel bucketed --bucket-mb 25" "--parallel torch-ddp --shard-optimizer" "--parallel fsdp"; do
    echo "== torchrun -m fastlm.train --preset small $mode"
    torchrun --nproc-per-node 2 -m fastlm.train --data "$WORK/train-data" --preset small --context 512 \
      --micro-batch 4 --steps 20 --log-every 20 --checkpoint-every 0 --out "$WORK/train-smoke" $mode 2>&1 \
      | grep -E "step 20/20|Error|error" | tail -3
  done
fi
ls -la "$OUT"
