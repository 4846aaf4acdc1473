#!/usr/bin/env bash
# The continued-training benchmark: dense-llama-byte -> MSA (block 64, top-8, layer 0 dense) -> KL distillation of the
# index branch -> continued training (LM loss + LOSS_COEFF x KL, sparse attention active) from the distilled
# checkpoint, both on calib_code.bin -> `m3c eval` of the distilled and of the trained model on eval_code.bin.
# The question it answers: does continued training lower the sparse eval loss compared with distillation alone?
# The control: the same distillation resumed for as many more steps as training took (equal step count).
#
#   benchmarks/train_quality.sh [SHARED_DIR] [OUT_DIR]
#   env: DEVICE (cuda), SEQ (8192), DISTILL_STEPS (200), TRAIN_STEPS (200), BATCH (4), LR_DISTILL (3e-3),
#        LR_TRAIN (1e-5), LOSS_COEFF (1.0), WARMUP (50), M3C (m3c), WINDOWS (evaluated windows; default all)
set -euo pipefail
SHARED=${1:-../shared}
OUT=${2:-train-bench}
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-8192}
BATCH=${BATCH:-4}
M3C=${M3C:-m3c}
EVAL=(--data "$SHARED/data/eval_code.bin" --seq-len "$SEQ" --device "$DEVICE" --json ${WINDOWS:+--max-windows "$WINDOWS"})
mkdir -p "$OUT"
t() { local start=$SECONDS; "$@"; echo "  $((SECONDS - start)) s: ${*:1:3}" >&2; }
t $M3C convert "$SHARED/checkpoints/dense-llama-byte" "$OUT/msa" --block-size 64 --topk 8 --dense-layers 0 --force --json >"$OUT/convert.json"
t $M3C distill "$OUT/msa" --data "$SHARED/data/calib_code.bin" --out "$OUT/distilled" --steps "${DISTILL_STEPS:-200}" \
  --seq-len "$SEQ" --batch "$BATCH" --lr "${LR_DISTILL:-3e-3}" --warmup-steps "${WARMUP:-50}" --checkpoint-every 1000 \
  --device "$DEVICE" --force --json >"$OUT/distill.json"
t $M3C eval "$OUT/distilled" "${EVAL[@]}" >"$OUT/eval_distilled.json"
t $M3C train "$OUT/distilled" --data "$SHARED/data/calib_code.bin" --out "$OUT/trained" --steps "${TRAIN_STEPS:-200}" \
  --seq-len "$SEQ" --batch "$BATCH" --lr "${LR_TRAIN:-1e-5}" --loss-coeff "${LOSS_COEFF:-1.0}" --checkpoint-every 1000 \
  --device "$DEVICE" --force --json >"$OUT/train.json"
t $M3C eval "$OUT/trained" "${EVAL[@]}" >"$OUT/eval_trained.json"
t $M3C distill "$OUT/msa" --data "$SHARED/data/calib_code.bin" --out "$OUT/distilled" \
  --steps $(( ${DISTILL_STEPS:-200} + ${TRAIN_STEPS:-200} )) --seq-len "$SEQ" --batch "$BATCH" --lr "${LR_DISTILL:-3e-3}" \
  --warmup-steps "${WARMUP:-50}" --checkpoint-every 1000 --device "$DEVICE" --resume --json >"$OUT/distill_control.json"
t $M3C eval "$OUT/distilled" "${EVAL[@]}" >"$OUT/eval_control.json"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for name in ("distilled", "trained", "control"):
    e = json.load(open(f"{out}/eval_{name}.json"))
    print(f"{name:>10}: dense {e['dense_loss']:.4f}  sparse {e['sparse_loss']:.4f} ({100 * e['loss_increase']:+.2f}%)  "
          f"mean recall {e['mean_recall']:.3f}  ({e['windows']} windows x {e['seq_len']})")
t = json.load(open(f"{out}/train.json"))
print(f"train: {t['seconds']:.1f} s, {t['tokens_per_s']:.0f} tok/s, LM {t['history'][0]['lm']:.4f} -> {t['history'][-1]['lm']:.4f}")
PY
