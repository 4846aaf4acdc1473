#!/usr/bin/env bash
# The quality figures on both checkpoints, at 8K: dense / oracle / weight-only init / calibrated init /
# distilled from the calibrated init, at block 64 / top-8 and M3's block 128 / top-16 (layer 0 dense), with the
# retrieval test. Every figure is an `m3c eval loss --json` or `m3c eval retrieval --json` file in OUT.
#
#   benchmarks/quality_real.sh HF_SMOLLM2_DIR CODE_DIR DATA_DIR OUT_DIR
#   CODE_DIR: what `python3 scripts/code_data.py DIR` writes (calib.bin, eval.bin); the byte model is the repository's
#             checkpoints/byte-llama
#   DATA_DIR: calib_code_smollm2.npy / eval_code_smollm2.npy (calib.bin / eval.bin decoded as UTF-8 with invalid
#             bytes replaced, through SmolLM2's tokenizer.json)
#   env: M3C (m3c), DEVICE (cuda), STEPS ("150": distillation totals, each evaluated, continued with --resume),
#        WARMUP (20), BATCH (2), LR (3e-3), CALIB_TOKENS (8192),
#        MODELS ("smollm2 byte"), SETTINGS ("64/8 128/16"), DISTILL_SETTINGS ("64/8": the settings distilled),
#        INDEX_DIM (--index-dim of both conversions; unset: the head dim), BLOCK_LOSS (unset: m3c distill's
#        default, 1; BENCHMARKS.md's token-KL rows ran it at 0)
# The wider head with its 0.01 init at both settings (evals of 128 / 16 take 40-80 s each on an H200):
#   MODELS=smollm2 DISTILL_SETTINGS="64/8 128/16" INDEX_DIM=128 STEPS="900" benchmarks/quality_real.sh ...
set -euo pipefail
HF=$1; CODE=$2; DATA=$3; OUT=$4
ROOT=$(cd "$(dirname "$0")/.." && pwd)
M3C=${M3C:-m3c}; DEVICE=${DEVICE:-cuda}; STEPS=${STEPS:-150}; WARMUP=${WARMUP:-20}; BATCH=${BATCH:-2}; LR=${LR:-3e-3}
CT=${CALIB_TOKENS:-8192}
IDX=(${INDEX_DIM:+--index-dim $INDEX_DIM}); BL=(${BLOCK_LOSS:+--block-loss $BLOCK_LOSS})
mkdir -p "$OUT"
t() { local start=$SECONDS; "$@"; echo "  $((SECONDS - start)) s: ${*:1:4}" >&2; }
for model in ${MODELS:-smollm2 byte}; do
  if [ $model = smollm2 ]; then src=$HF; calib=$DATA/calib_code_smollm2.npy; ev=$DATA/eval_code_smollm2.npy
  else src=$ROOT/checkpoints/byte-llama; calib=$CODE/calib.bin; ev=$CODE/eval.bin; fi
  for setting in ${SETTINGS:-64/8 128/16}; do
    set -- ${setting/\// }; tag=$model-b$1k$2
    t $M3C convert "$src" "$OUT/$tag-w" --block-size $1 --topk $2 --dense-layers 0 "${IDX[@]}" --force --json \
      >"$OUT/$tag-w.convert.json"
    t $M3C convert "$src" "$OUT/$tag-c" --block-size $1 --topk $2 --dense-layers 0 "${IDX[@]}" --calib "$calib" \
      --calib-tokens $CT --calib-device "$DEVICE" --force --json >"$OUT/$tag-c.convert.json"
    t $M3C eval loss "$OUT/$tag-w" --data "$ev" --seq-len 8192 --device "$DEVICE" --json >"$OUT/$tag-w.eval.json"
    t $M3C eval loss "$OUT/$tag-c" --data "$ev" --seq-len 8192 --device "$DEVICE" --json --no-oracle >"$OUT/$tag-c.eval.json"
    if [[ " ${DISTILL_SETTINGS:-64/8} " == *" $setting "* ]]; then
      resume=(--force)
      for steps in $STEPS; do
        t $M3C distill "$OUT/$tag-c" --data "$calib" --out "$OUT/$tag-d" --steps $steps --warmup-steps $WARMUP \
          --seq-len 8192 --batch $BATCH --lr $LR --checkpoint-every 100000 --device "$DEVICE" "${resume[@]}" "${BL[@]}" --json \
          >"$OUT/$tag-d$steps.distill.json"
        t $M3C eval loss "$OUT/$tag-d" --data "$ev" --seq-len 8192 --device "$DEVICE" --json --no-oracle >"$OUT/$tag-d$steps.eval.json"
        resume=(--resume)
      done
      t $M3C eval retrieval "$OUT/$tag-d" --data "$ev" --seq-len 8192 --device "$DEVICE" --json >"$OUT/$tag-d.retrieval.json"
    fi
  done
done
python3 - "$OUT" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(f"{sys.argv[1]}/*.eval.json")):
    e = json.load(open(f))
    o = e.get("oracle_loss_increase")
    print(f"{os.path.basename(f):28s} dense {e['dense_loss']:.4f} sparse {e['sparse_loss']:.4f} "
          f"({100 * e['loss_increase']:+.2f}%) oracle {'' if o is None else f'{100 * o:+.2f}%'} "
          f"tail {e['tail_share']:.3f} recall {e['mean_recall']:.3f} p10min {e['min_recall_p10']:.3f} ({e['seconds']} s)")
PY
