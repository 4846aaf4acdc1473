#!/usr/bin/env bash
# The block-ranking loss on the real SmolLM2 at 8K, block 64 / top-8, layer 0 dense: calibrated init (eval with
# the oracle row), then distilled with --block-loss L for each L of VARIANTS (0 = the token KL alone), each evaluated;
# with EXTEND, each run is resumed to EXTEND steps and evaluated again (a second point of its loss-vs-tokens curve).
# Everything ends up in one JSON, OUT_DIR/block_loss_quality.json (the GPU lease returns few files per call).
#
#   benchmarks/block_loss_quality.sh HF_SMOLLM2_DIR DATA_DIR OUT_DIR
#   DATA_DIR: calib_code_smollm2.npy / eval_code_smollm2.npy (see benchmarks/quality_real.sh)
#   env: M3C (m3c), DEVICE (cuda), STEPS (450), EXTEND (none; e.g. 900), VARIANTS ("0 1": block-loss weights),
#        TIMEOUT (per distillation, s; an interrupted run saves its state and is evaluated as it stands: its report
#        says which step)
# On an H200, VARIANTS=1 STEPS=900 EXTEND=1800 gave +2.25% / +2.14% (BENCHMARKS.md, "Quality").
set -euo pipefail
HF=$1; DATA=$2; OUT=$3
M3C=${M3C:-m3c}; DEVICE=${DEVICE:-cuda}; C=$DATA/calib_code_smollm2.npy; E=$DATA/eval_code_smollm2.npy
R=$OUT/runs; mkdir -p "$R"
$M3C convert "$HF" "$OUT/c" --block-size 64 --topk 8 --dense-layers 0 --calib "$C" --calib-tokens 8192 \
  --calib-device "$DEVICE" --force --json > "$R/c.convert.json"
$M3C eval "$OUT/c" --data "$E" --seq-len 8192 --device "$DEVICE" --json > "$R/c.eval.json"
common=(--data "$C" --seq-len 8192 --batch 2 --lr 3e-3 --warmup-steps 20 --checkpoint-every 100000 --device "$DEVICE" --json)
for L in ${VARIANTS:-0 1}; do
  for total in ${STEPS:-450} ${EXTEND:-}; do
    again=(--force); [ "$total" != "${STEPS:-450}" ] && again=(--resume)
    timeout "${TIMEOUT:-3600}" $M3C distill "$OUT/c" --out "$OUT/d$L" --steps "$total" --block-loss "$L" "${again[@]}" \
      "${common[@]}" > "$R/d${L}_$total.distill.json" \
      || echo "distillation with --block-loss $L to $total steps stopped (status $?): evaluating its saved state"
    $M3C eval "$OUT/d$L" --data "$E" --seq-len 8192 --device "$DEVICE" --no-oracle --json > "$R/d${L}_$total.eval.json"
  done
done
python3 - "$R" "$OUT/block_loss_quality.json" <<'PY'
import json, pathlib, sys
out = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    text = f.read_text()
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    d = json.JSONDecoder().raw_decode(text[start:])[0] if start >= 0 else None
    if isinstance(d, dict) and f.name.endswith(".distill.json"):  # the per-step history is large: keep its curve
        d = {k: v for k, v in d.items() if k != "history"} | {"kl_curve": [(h["step"], h["kl"]) for h in d.get("history", [])]}
    out[f.name] = d
pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
print(f"wrote {sys.argv[2]}")
PY
