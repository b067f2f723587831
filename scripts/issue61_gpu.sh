#!/usr/bin/env bash
# Issue #61's runs on one lent GPU (docs/results/preregistration-lorentz.md), with the code the pre-registration pins
# (PIN_SRC: a copy of 96d9ed7's src/), each in WORK/NAME; what a landing needs (ablation.json, logs, metrics.jsonl) is
# packed into OUT/runs.tar.gz when they all end or LIMIT seconds are near (land each with `topoclip report land`).
# - precision (default; landed 2026-11-30): each hyperbolic family at its lr (stage 1's rule: lorentz_lr-5e-4,
#   lorentz-product_lr-1e-3), seed 0, 9,600 steps, in bf16, fp16 and fp32 (TF32 off: the like-for-like twin on the
#   same GPU), all six at once (~440 s on an H200 with 16 cores); then, with the time left, gpu_check.py's shards steps.
# - rerun: the re-run check, one more seed of `lorentz` at its lr (seed 5, 19,200 steps, fp32 with TF32 off) on this
#   other machine, to land inside docs/results/lorentz-19200-reruns.json's prediction interval (the block
#   lorentz-19200-rerun-check reads it once landed). Alone it may outlast one call: its trainer runs on (setsid) while
#   the machine is warm, and the same command in the next call, within the machine's 30 s, waits for it rather than
#   starting it again (WORK/NAME.pid).
#
#   PIN_SRC=.pin/src WORK=.gpuwork OUT=$OUT bash scripts/issue61_gpu.sh 560 [precision|rerun]
#   PIN_SRC=.pin/src WORK=/tmp/w OUT=/tmp/o DEVICE=cpu STEPS=40 PRESET=tiny bash scripts/issue61_gpu.sh 300   # rehearsal
set -u
limit=${1:-560}
arm=${2:-precision}
case "$arm" in precision|rerun) ;; *) echo "issue61_gpu: the arm is precision or rerun, not '$arm'" >&2; exit 2;; esac
start=$SECONDS
device=${DEVICE:-cuda}
default_steps=9600  # the precision arm's
[ "$arm" = rerun ] && default_steps=19200  # the cell's schedule
steps=${STEPS:-$default_steps}
mkdir -p "$WORK" "$OUT"
preset=()
[ -n "${PRESET:-}" ] && preset=(--preset "$PRESET")
train() {  # NAME CELL SEED STEPS PRECISION
  local tf32=()
  [ "$5" = fp32 ] && tf32=(--set train.allow_tf32=false)
  names+=("$1")
  [ -f "$WORK/$1/ablation.json" ] && return
  alive "$1" && return  # started by an earlier call on this machine, still training
  OMP_NUM_THREADS=2 PYTHONPATH="$PIN_SRC${PYTHONPATH:+:$PYTHONPATH}" setsid python3 -m topoclip ablate \
    --grid lorentz --steps "$4" --cells "$2" --first-seed "$3" --seeds 1 "${preset[@]}" \
    --set "train.device=$device" --set "train.precision=$5" "${tf32[@]}" --out "$WORK/$1" > "$WORK/$1.log" 2>&1 &
  echo $! > "$WORK/$1.pid"
}
alive() { [ -f "$WORK/$1.pid" ] && kill -0 "$(cat "$WORK/$1.pid")" 2>/dev/null; }
names=()
if [ "$arm" = rerun ]; then
  train "lorentz-19200-rerun-gpu-lorentz_lr-5e-4-seed5" lorentz_lr-5e-4 5 "$steps" fp32
else
  for precision in bf16 fp16 fp32; do
    for cell in lorentz_lr-5e-4 lorentz-product_lr-1e-3; do
      train "lorentz-precision-$precision-${cell%%_lr-*}" "$cell" 0 "$steps" "$precision"
    done
  done
fi
pack() {
  tar -czf "$OUT/runs.tar.gz" --exclude=checkpoints --exclude=tensorboard --exclude='*.png' \
    -C "$WORK" $(cd "$WORK" && ls -d "${names[@]}" "${names[@]/%/.log}" 2>/dev/null)
  for name in "${names[@]}"; do echo "== $name"; tail -n 3 "$WORK/$name.log"; done
}
ended() { local n=0 name; for name in "${names[@]}"; do [ -f "$WORK/$name/ablation.json" ] && n=$((n + 1)); done; echo $n; }
while [ $((SECONDS - start)) -lt $((limit - 25)) ]; do
  [ "$(ended)" -ge ${#names[@]} ] && break
  running=0
  for name in "${names[@]}"; do alive "$name" && running=1; done
  [ "$running" = 0 ] && break  # a run that died writes no ablation.json: its log says why
  sleep 10
  echo "$((SECONDS - start)) s: $(ended) of ${#names[@]} ended;" \
    "steps $(for name in "${names[@]}"; do tail -n 1 "$WORK/$name"/runs/*/seed-*/metrics.jsonl 2>/dev/null \
    | python3 -c 'import json,sys; print(json.loads(sys.stdin.read() or "{}").get("step", "-"), end=" ")'; done)"
done
pack
left=$((limit - (SECONDS - start)))
if [ "$arm" = precision ] && [ "$(ended)" -ge ${#names[@]} ] && [ "$left" -gt 150 ]; then
  check=$(mktemp -d)/check
  python3 benchmarks/gpu_check.py --device "$device" ${PRESET:+--tiny} --out "$check" --budget $((left - 20)) \
    --only shards_workers,shards_epochs
  cp "$check/check.json" "$check/report.txt" "$OUT/"
fi
exit 0
