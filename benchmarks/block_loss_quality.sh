#!/usr/bin/env bash
# Issue 15's block-ranking loss on the real SmolLM2 at 8K, block 64 / top-8, layer 0 dense: calibrated init (eval with
# the oracle row), then distilled with the token KL alone and with --block-loss L, each evaluated.
#
#   benchmarks/block_loss_quality.sh HF_SMOLLM2_DIR DATA_DIR OUT_DIR
#   DATA_DIR: calib_code_smollm2.npy / eval_code_smollm2.npy (see benchmarks/quality_real.sh)
#   env: M3C (m3c), DEVICE (cuda), STEPS (450), VARIANTS ("0 1": block-loss weights), TIMEOUT (per distillation, s;
#        an interrupted run saves its state and is evaluated as it stands: its report says which step)
set -euo pipefail
HF=$1; DATA=$2; OUT=$3
M3C=${M3C:-m3c}; DEVICE=${DEVICE:-cuda}; C=$DATA/calib_code_smollm2.npy; E=$DATA/eval_code_smollm2.npy
mkdir -p "$OUT"
$M3C convert "$HF" "$OUT/c" --block-size 64 --topk 8 --dense-layers 0 --calib "$C" --calib-tokens 8192 \
  --calib-device "$DEVICE" --force --json > "$OUT/c.convert.json"
$M3C eval "$OUT/c" --data "$E" --seq-len 8192 --device "$DEVICE" --json > "$OUT/c.eval.json"
for L in ${VARIANTS:-0 1}; do
  timeout "${TIMEOUT:-3600}" $M3C distill "$OUT/c" --data "$C" --out "$OUT/d$L" --steps "${STEPS:-450}" --warmup-steps 20 \
    --seq-len 8192 --batch 2 --lr 3e-3 --checkpoint-every 100000 --device "$DEVICE" --block-loss "$L" --force --json \
    > "$OUT/d$L.distill.json" || echo "distillation with --block-loss $L stopped (status $?): evaluating its saved state"
  $M3C eval "$OUT/d$L" --data "$E" --seq-len 8192 --device "$DEVICE" --no-oracle --json > "$OUT/d$L.eval.json"
done
