#!/usr/bin/env bash
# GPU-machine runs for the language model (one PART per call, each under 10 minutes):
#   PART=check    model GPU tests, a few bench rows, profile of small, memory of 2.7b
#   PART=sweep    PRESETS=a,b  the bench sweep (all modes, precisions, eager/compile) for those presets
#   PART=targets  xl and 2.7b training steps: bf16 + COMPILE (default compile; or cudagraphs, or
#                 both), torch vs fastlm kernels vs HF Llama, at BATCH (default 4)
#   PART=big      the 10b preset (eager rows, then compiled rows for at most LAST_S seconds)
#   PART=profile  the committed profile of small, the memory table of 2.7b, 2.7b at batch 16, then
#                 10b (bf16, compiled) for at most LAST_S seconds
#   PART=switch   SWITCH=norm|attention|loss: the compiled training step of PRESETS (default xl)
#                 with PyTorch kernels, then with only that switch on fastlm (which kernel costs what)
#   PART=e2e      the end-to-end matrix in one run: PRESETS (default xl) at BATCH (default 4) x
#                 context 512, train, PRECISION (default bf16-weights), torch and fastlm kernels x
#                 COMPILE (default eager,compile,
#                 cudagraphs), plus HF Llama (HF=0 leaves it out), ROUNDS rounds (default 3),
#                 interleaved when every model fits in memory at once (the records say which)
#   PART=e2e-warm the same matrix, 1 round of 1 step, records thrown away: fills the Inductor and Triton
#                 caches that PART=e2e then hits. Cold, xl compiles for 2-4 minutes per (model, compile
#                 mode), over 15 minutes for the matrix: repeat until it prints "warm: done" (each call
#                 stops after LAST_S, default 540 s, and resumes from the cache)
#   PART=profile-step  the compiled step's GPU time per kernel category, torch vs fastlm kernels, x COMPILE
#                 (default compile,cudagraphs) x OPTIMIZER (AdamW: torch (default), fastlm or both), on
#                 LAYERS (default 12) blocks of the xl width (benchmarks/profile_compiled_step.py)
# Records, reports and plots are packed into $OUT/model_out.tar.gz (bulky traces and snapshots
# stay on the machine; their sizes are listed).
set -uo pipefail
OUT=${OUT:-gpu-out}
WORK=/tmp/fastlm-model
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | tail -1
pack() { tar -czf "$OUT/model_out.tar.gz" -C "$WORK" results reports; }
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
    --compile "${COMPILE:-compile}" --kernels torch,fastlm --hf --out "$WORK" 2>&1 | tail -20
  ;;
big)
  # the 10b preset in two invocations (records are appended per invocation): eager, then compiled
  fastlm bench model --preset 10b --mode fwd,fwd+bwd,train --precision fp32,bf16 --compile eager \
    --warmup 2 --steps 5 --out "$WORK" 2>&1 | grep "| fastlm"
  pack
  timeout "${LAST_S:-400}" fastlm bench model --preset 10b --mode fwd,fwd+bwd,train --precision bf16,fp32 \
    --compile compile --warmup 2 --steps 5 --out "$WORK" 2>&1 | grep "| fastlm"
  ;;
profile)
  fastlm profile model --preset small --out "$WORK" 2>&1 | tail -12
  pack
  fastlm profile memory --out "$WORK" 2>&1 | tail -22
  pack
  # MFU at a larger batch: the optimizer step's fixed cost spread over 4x the tokens
  fastlm bench model --preset 2.7b --batch 16 --mode fwd+bwd,train --precision bf16 --compile compile \
    --warmup 3 --out "$WORK" 2>&1 | grep "| fastlm"
  pack
  timeout "${LAST_S:-200}" fastlm bench model --preset 10b --mode fwd,fwd+bwd,train --precision bf16 \
    --compile compile --warmup 3 --out "$WORK" 2>&1 | grep "| fastlm"
  ;;
switch)
  # one invocation (one run): the PyTorch kernel set, and the fastlm set with the other switches
  # pinned back to PyTorch, so only SWITCH differs between the two rows
  case "${SWITCH:?set SWITCH to norm, attention or loss}" in
    norm) pin="--attention sdpa --loss torch" ;;
    attention) pin="--norm torch --loss torch" ;;
    loss) pin="--attention sdpa --norm torch" ;;
  esac
  fastlm bench model --preset "${PRESETS:-xl}" --batch "${BATCH:-4}" --mode train --precision bf16 \
    --compile compile --kernels torch,fastlm $pin --out "$WORK" 2>&1 | tail -8
  ;;
profile-step)
  python3 benchmarks/profile_compiled_step.py --layers "${LAYERS:-12}" --compile "${COMPILE:-compile,cudagraphs}" --optimizer "${OPTIMIZER:-torch}" --out "$WORK" 2>&1 | tail -8
  ;;
e2e|e2e-warm)
  export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor-cache"  # shared by the warm-up and the measured run
  hf=$([ "${HF:-1}" = 1 ] && echo --hf)
  matrix=(--preset "${PRESETS:-xl}" --batch "${BATCH:-4}" --context 512 --mode train
          --precision "${PRECISION:-bf16-weights}"
          --kernels torch,fastlm --compile "${COMPILE:-eager,compile,cudagraphs}" $hf)
  if [ "$PART" = e2e-warm ]; then
    timeout "${LAST_S:-540}" fastlm bench model "${matrix[@]}" --rounds 1 --warmup 0 --steps 1 --no-interleave \
      --out "$WORK/warm" 2>&1 | tail -3
    [ "${PIPESTATUS[0]}" = 0 ] && echo "warm: done" || echo "warm: not done, run PART=e2e-warm again"
  else
    timeout "${LAST_S:-570}" fastlm bench model "${matrix[@]}" --rounds "${ROUNDS:-3}" --warmup 5 --steps 10 \
      --out "$WORK" 2>&1 | tail -40
  fi
  ;;
esac
ls -la "$WORK"/traces "$WORK"/snapshots 2>/dev/null
pack
