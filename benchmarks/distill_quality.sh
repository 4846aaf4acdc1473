#!/usr/bin/env bash
# Issue 3's quality benchmark: dense-llama-byte -> MSA (block 64, top-8, layer 0 dense) -> KL distillation of the
# index branch on calib_code.bin -> `m3c eval` on the held-out eval_code.bin, at initialisation and after each
# entry of STEPS (the run is continued with --resume between them).
#
#   benchmarks/distill_quality.sh [SHARED_DIR] [OUT_DIR]
#   env: DEVICE (cuda), SEQ (8192), STEPS ("100 300"), BATCH (4), LR (1e-3), WARMUP (50), M3C (m3c),
#        WINDOWS (evaluated windows; default all)
set -euo pipefail
SHARED=${1:-../shared}
OUT=${2:-distill-bench}
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-8192}
STEPS=${STEPS:-"100 300"}
BATCH=${BATCH:-4}
LR=${LR:-1e-3}
WARMUP=${WARMUP:-50}
M3C=${M3C:-m3c}
EVAL=(--data "$SHARED/data/eval_code.bin" --seq-len "$SEQ" --device "$DEVICE" --json ${WINDOWS:+--max-windows "$WINDOWS"})
mkdir -p "$OUT"
t() { local start=$SECONDS; "$@"; echo "  $((SECONDS - start)) s: ${*:1:3}" >&2; }
t $M3C convert "$SHARED/checkpoints/dense-llama-byte" "$OUT/msa" --block-size 64 --topk 8 --dense-layers 0 --force --json >"$OUT/convert.json"
t $M3C eval "$OUT/msa" "${EVAL[@]}" >"$OUT/eval_init.json"
resume=(--force)
for s in $STEPS; do
  t $M3C distill "$OUT/msa" --data "$SHARED/data/calib_code.bin" --out "$OUT/distilled" --steps "$s" --seq-len "$SEQ" \
    --batch "$BATCH" --lr "$LR" --warmup-steps "$WARMUP" --checkpoint-every 1000 --device "$DEVICE" "${resume[@]}" --json >"$OUT/distill_$s.json"
  t $M3C eval "$OUT/distilled" "${EVAL[@]}" >"$OUT/eval_$s.json"
  resume=(--resume)
done
python3 - "$OUT" $STEPS <<'PY'
import json, sys
out, steps = sys.argv[1], sys.argv[2:]
for name in ["init", *steps]:
    e = json.load(open(f"{out}/eval_{name}.json"))
    rec = " ".join(f"L{k} {v:.3f}" for k, v in e["recall"].items())
    print(f"{name:>5}: dense {e['dense_loss']:.4f}  sparse {e['sparse_loss']:.4f} ({100 * e['loss_increase']:+.2f}%)  "
          f"mean recall {e['mean_recall']:.3f}  [{rec}]  ({e['windows']} windows x {e['seq_len']}, {e['seconds']} s)")
for s in steps:
    d = json.load(open(f"{out}/distill_{s}.json"))
    print(f"distill to step {s}: {d['seconds']:.1f} s, {d['tokens_per_s']:.0f} tok/s, last KL {d['history'][-1]['kl']:.4f}")
PY
