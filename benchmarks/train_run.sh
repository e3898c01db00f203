#!/usr/bin/env bash
# Run book of `fastlm train` (python -m fastlm.train) against its targets, one PART per call:
#   PART=data    the corpus: this repository's text and the Python standard library's sources
#                (UTF-8 files only, about 30 MB), prepared with the bytes tokenizer into $WORK/data
#   PART=speed   rounds ROUNDS (default "1 2 3") of: one process, then for each count in PROCS
#                (default 2; "2 4" for both) torchrun with that many processes under each of MODES,
#                at the same per-process batch; then `fastlm bench model` of the same step.
#                Steady-state tokens/s and MFU per run, the scaling is tokens/s(P) / tokens/s(1) of
#                the same round; each run's record is appended as soon as it finishes
#   PART=loss    LOSS_STEPS steps (default 200) at one global batch (MICRO windows on each of the
#                largest count of PROCS): one process (accumulating micro-batches), each count of
#                PROCS under each of LOSS_MODES (default ddp), and one process with the fastlm
#                kernels; the curves' relative differences against the first
#   PART=links   `fastlm bench allreduce` on the largest count of PROCS: the bandwidth the
#                gradients' all-reduce gets on this machine (10, 100 and 1000 MB)
#   PART=independent  one process alone, then the largest count of PROCS one-process runs at once,
#                one per GPU: with no communication at all, does a busy machine (power, host cores,
#                host memory) slow each GPU's step? The ceiling of any scaling on this machine
#   PART=profile  for each of MODES, torchrun with the largest count of PROCS under
#                benchmarks/profile_train_step.py: each rank's GPU per step (compute, communication,
#                exposed communication, overlap, idle) into $OUT/profile_train.jsonl, traces in
#                $WORK/traces
#   PART=precision  LOSS_STEPS steps in one process, --precision bf16 and bf16-weights x --kernels torch
#                and fastlm: throughput and the curves' relative differences against bf16 / torch
# Sizes: PRESET (default small), CONTEXT (default 2048), MICRO (sequences per process per
# micro-batch, default 8), SPEED_STEPS (default 150). PART=speed: MODES (default "ddp fsdp"),
# KERNELS (default torch), PARALLEL_ARGS (more options of the multi-process runs, e.g.
# "--reduce-dtype bf16"; their folders then end in TAG, default "-args"), ROUNDS (default "1 2 3"),
# BENCH_MODEL=0 skips the `fastlm bench model` row. On a GPU the loop's defaults are bf16 and
# compile. CPU-sized: PRESET=tiny CONTEXT=128 MICRO=8 SPEED_STEPS=60 LOSS_STEPS=100 ROUNDS=1.
# Everything lands in $WORK (default /tmp/fastlm-train); the records, tables and plots in $OUT.
set -euo pipefail
WORK=${WORK:-/tmp/fastlm-train}
OUT=${OUT:-gpu-out}
PRESET=${PRESET:-small} CONTEXT=${CONTEXT:-2048} MICRO=${MICRO:-8} PROCS=${PROCS:-2} KERNELS=${KERNELS:-torch}
MOST=$(printf '%s\n' $PROCS | sort -n | tail -1)  # the largest count: the evaluation set and the loss runs' batch fit it
mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1
# the corpus is one document (all files in one), so --no-documents changes nothing but the kernels'
# path: the plain causal one, as the earlier records measured
COMMON=(--data "$WORK/data" --preset "$PRESET" --context "$CONTEXT" --micro-batch "$MICRO" --checkpoint-every 0
        --eval-every 0 --eval-sequences $((MICRO * MOST)) --no-documents --kernels "$KERNELS")
table() {  # a table of the runs given and their curves' plot
  python3 benchmarks/train_records.py "$@" --plot "$OUT/train_$PART.png" | tee -a "$OUT/train_$PART.md"
}
summary() {  # the table, and the runs' records appended
  table "$@" --results "$OUT/train.jsonl"
}
record() {  # one finished run's record appended at once: a later run cut off or failing loses nothing before it
  python3 benchmarks/train_records.py "$1" --results "$OUT/train.jsonl" > /dev/null
}
case ${PART:?set PART to data, speed, loss, links, independent, profile or precision} in
data)
  python3 - "$WORK/corpus" <<'PY'
import pathlib, sys, sysconfig
out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
files = sorted(pathlib.Path(".").glob("**/*.md")) + sorted(pathlib.Path("src").glob("**/*.py"))
stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
files += sorted(p for p in stdlib.glob("**/*.py") if "site-packages" not in p.relative_to(stdlib).parts)
kept = 0
with open(out / "corpus.txt", "w") as f:
    for path in files:
        try:
            f.write(path.read_text(encoding="utf-8") + "\n")
            kept += 1
        except (UnicodeDecodeError, OSError):
            pass  # the standard library ships a few test files in other encodings
print(f"{kept} of {len(files)} files, {(out / 'corpus.txt').stat().st_size / 1e6:.1f} MB")
PY
  python3 -m fastlm.data prepare --input "$WORK/corpus/corpus.txt" --tokenizer bytes --out "$WORK/data"
  ;;
speed)
  STEPS=(--steps "${SPEED_STEPS:-150}" --warmup 10 --log-every 10)
  runs=()
  for round in ${ROUNDS:-1 2 3}; do
    python3 -m fastlm.train "${COMMON[@]}" "${STEPS[@]}" --out "$WORK/speed-$KERNELS-r$round-1" | tail -2
    runs+=("$WORK/speed-$KERNELS-r$round-1")
    record "${runs[-1]}"
    for procs in $PROCS; do
      for mode in ${MODES:-ddp fsdp}; do
        name="speed-$KERNELS-r$round-$procs$mode${PARALLEL_ARGS:+${TAG:--args}}"
        # shellcheck disable=SC2086  # PARALLEL_ARGS: several options, split on purpose
        torchrun --nproc-per-node "$procs" -m fastlm.train "${COMMON[@]}" "${STEPS[@]}" --parallel "$mode" \
          ${PARALLEL_ARGS:-} --out "$WORK/$name" 2>&1 | grep -v "^W.*torch/distributed/run.py" | tail -2
        runs+=("$WORK/$name")
        record "${runs[-1]}"
      done
    done
  done
  table "${runs[@]}"
  [ "${BENCH_MODEL:-1}" = 0 ] && exit 0
  python3 -m fastlm bench model --preset "$PRESET" --context "$CONTEXT" --batch "$MICRO" --vocab 320 --mode train \
    --precision bf16 --compile compile --rounds "$(wc -w <<< "${ROUNDS:-1 2 3}")" --out "$WORK" 2>&1 | grep -E "tokens/s|\| fastlm" \
    | tee -a "$OUT/train_$PART.md"
  cp "$WORK/results/model.jsonl" "$OUT/train_bench_model.jsonl"
  ;;
loss)
  STEPS=(--steps "${LOSS_STEPS:-200}" --warmup 20 --log-every 10 --batch-tokens $((CONTEXT * MICRO * MOST)))
  python3 -m fastlm.train "${COMMON[@]}" "${STEPS[@]}" --out "$WORK/loss-1" | tail -2
  runs=("$WORK/loss-1")
  for procs in $PROCS; do
    for mode in ${LOSS_MODES:-ddp}; do
      torchrun --nproc-per-node "$procs" -m fastlm.train "${COMMON[@]}" "${STEPS[@]}" --parallel "$mode" \
        --out "$WORK/loss-$procs-$mode" 2>&1 | grep -v "^W.*torch/distributed/run.py" | tail -2
      runs+=("$WORK/loss-$procs-$mode")
    done
  done
  python3 -m fastlm.train "${COMMON[@]}" "${STEPS[@]}" --kernels fastlm --out "$WORK/loss-1-fastlm" | tail -2
  summary "${runs[@]}" "$WORK/loss-1-fastlm"
  ;;
links)
  python3 -m fastlm bench allreduce --procs "$MOST" --sizes-mb 10,100,1000 --out "$WORK/links" 2>&1 | grep "^| nccl\|^| gloo"
  cp "$WORK/links/results/allreduce.jsonl" "$OUT/allreduce.jsonl"
  ;;
independent)
  STEPS=(--steps "${SPEED_STEPS:-150}" --warmup 10 --log-every 10)
  python3 -m fastlm.train "${COMMON[@]}" "${STEPS[@]}" --out "$WORK/alone" | tail -1
  runs=("$WORK/alone") pids=()
  for gpu in $(seq 0 $((MOST - 1))); do
    CUDA_VISIBLE_DEVICES=$gpu python3 -m fastlm.train "${COMMON[@]}" "${STEPS[@]}" --out "$WORK/together-$gpu" \
      > "$WORK/together-$gpu.txt" 2>&1 &
    runs+=("$WORK/together-$gpu") pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # a failed run stops the script (set -e), a bare wait would not
  summary "${runs[@]}"
  ;;
profile)
  for mode in ${MODES:-ddp fsdp}; do
    RESULTS="$OUT/profile_train.jsonl" TRACE_DIR="$WORK/traces/$MOST$mode" torchrun --nproc-per-node "$MOST" \
      benchmarks/profile_train_step.py "${COMMON[@]}" --steps 30 --warmup 10 --log-every 10 --parallel "$mode" \
      --out "$WORK/profile-$KERNELS-$MOST$mode" --overwrite 2>&1 | { grep "^rank [0-9]*:" || true; }  # none on CPU
  done
  ;;
precision)
  STEPS=(--steps "${LOSS_STEPS:-200}" --warmup 20 --log-every 10)
  runs=()
  for kernels in torch fastlm; do
    for precision in bf16 bf16-weights; do
      python3 -m fastlm.train "${COMMON[@]}" "${STEPS[@]}" --kernels "$kernels" --precision "$precision" \
        --out "$WORK/precision-$kernels-$precision" | tail -2
      runs+=("$WORK/precision-$kernels-$precision")
    done
  done
  summary "${runs[@]}"
  ;;
esac
