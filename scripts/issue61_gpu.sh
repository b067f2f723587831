#!/usr/bin/env bash
# Issue #61's precision arm on one lent GPU (docs/results/preregistration-lorentz.md, stability): each hyperbolic
# family at its lr (stage 1's rule: lorentz_lr-5e-4, lorentz-product_lr-1e-3), seed 0, 9,600 steps, in bf16, in fp16
# and in fp32 (TF32 off: the like-for-like twin on the same GPU), all six at once, with the code the pre-registration
# pins (PIN_SRC: a copy of 96d9ed7's src/). Each run trains in WORK/lorentz-precision-P-FAMILY; what a landing needs
# (ablation.json, logs, metrics.jsonl) is packed into OUT/precision.tar.gz when all six end or SECONDS_LEFT is near.
# Then, with the time left, gpu_check.py's shards steps (the loader beside the compiled step: SharedEpoch's effect).
#
#   PIN_SRC=.pin/src WORK=.gpuwork OUT=$OUT bash scripts/issue61_gpu.sh 560
#   PIN_SRC=.pin/src WORK=/tmp/w OUT=/tmp/o DEVICE=cpu STEPS=40 PRESET=tiny bash scripts/issue61_gpu.sh 300   # rehearsal
set -u
limit=${1:-560}
start=$SECONDS
device=${DEVICE:-cuda}
steps=${STEPS:-9600}
mkdir -p "$WORK" "$OUT"
preset=()
[ -n "${PRESET:-}" ] && preset=(--preset "$PRESET")
for precision in bf16 fp16 fp32; do
  for cell in lorentz_lr-5e-4 lorentz-product_lr-1e-3; do
    name="lorentz-precision-$precision-${cell%%_lr-*}"
    tf32=()
    [ "$precision" = fp32 ] && tf32=(--set train.allow_tf32=false)
    [ -f "$WORK/$name/ablation.json" ] && continue
    OMP_NUM_THREADS=2 PYTHONPATH="$PIN_SRC${PYTHONPATH:+:$PYTHONPATH}" setsid python3 -m topoclip ablate \
      --grid lorentz --steps "$steps" --cells "$cell" --first-seed 0 --seeds 1 "${preset[@]}" \
      --set "train.device=$device" --set "train.precision=$precision" "${tf32[@]}" \
      --out "$WORK/$name" > "$WORK/$name.log" 2>&1 &
  done
done
pack() {
  tar -czf "$OUT/precision.tar.gz" --exclude=checkpoints --exclude=tensorboard --exclude='*.png' \
    -C "$WORK" $(cd "$WORK" && ls -d lorentz-precision-* 2>/dev/null)
  for log in "$WORK"/*.log; do echo "== $log"; tail -n 3 "$log"; done
}
while [ $((SECONDS - start)) -lt $((limit - 25)) ]; do
  [ "$(ls "$WORK"/lorentz-precision-*/ablation.json 2>/dev/null | wc -l)" -ge 6 ] && break
  sleep 10
  echo "$((SECONDS - start)) s: $(ls "$WORK"/lorentz-precision-*/ablation.json 2>/dev/null | wc -l) of 6 ended;" \
    "steps $(for m in "$WORK"/lorentz-precision-*/runs/*/seed-0/metrics.jsonl; do tail -n 1 "$m" 2>/dev/null \
    | python3 -c 'import json,sys; print(json.loads(sys.stdin.read() or "{}").get("step", "-"), end=" ")'; done)"
done
pack
left=$((limit - (SECONDS - start)))
if [ "$(ls "$WORK"/lorentz-precision-*/ablation.json 2>/dev/null | wc -l)" -ge 6 ] && [ "$left" -gt 150 ]; then
  python3 benchmarks/gpu_check.py --device "$device" ${PRESET:+--tiny} --out /tmp/check --budget $((left - 20)) \
    --only shards_workers,shards_epochs
  cp /tmp/check/check.json /tmp/check/report.txt "$OUT/"
fi
exit 0
