#!/usr/bin/env bash
# The RULER-style suite on the real 32K-context model: Qwen2.5-Coder-0.5B-Instruct (as scripts/qwen25_coder.py
# builds it) converted at block 128 / top-16 with a 128-wide index head calibrated on long code, then
# `m3c eval ruler` with dense, index and oracle selection at 4K-32K, 25 samples per task and length, on the
# held-out long code; and the 32K loss eval with and without its oracle row (their seconds show what the oracle
# pass costs). Every figure is a JSON file in OUT, the heatmap OUT/ruler.png.
#
#   benchmarks/ruler_real.sh HF_QWEN_DIR LONG_CODE_DIR OUT_DIR
#   LONG_CODE_DIR: what `python3 scripts/long_code.py DIR` writes (long_code_calib.txt, long_code_eval.txt)
#   env: M3C (m3c), DEVICE (cuda), MODEL (a converted or distilled checkpoint to evaluate instead of converting
#        HF_QWEN_DIR), SAMPLES (25), LENGTHS (4K,8K,16K,32K), SELECTIONS (dense,index,oracle), BLOCK (128),
#        TOPK (16), CALIB_TOKENS (65536), LOSS_WINDOWS (8; 0 skips the loss evals)
# On one H200 the suite took 424 s (11 tasks x 4 lengths x 25 samples x 3 selections: prompts built on the CPU in
# 20 s, 25 prompts per generation batch, the decode step replayed as a CUDA graph; dense 116 s, MSA 93 s, oracle
# 195 s); the calibrated conversion 16 s; each loss eval of 4 windows of 32K 15 s with the process start.
set -euo pipefail
HF=$1; LONG=$2; OUT=$3
M3C=${M3C:-m3c}; DEVICE=${DEVICE:-cuda}; SAMPLES=${SAMPLES:-25}; LENGTHS=${LENGTHS:-4K,8K,16K,32K}
SELECTIONS=${SELECTIONS:-dense,index,oracle}; BLOCK=${BLOCK:-128}; TOPK=${TOPK:-16}; CT=${CALIB_TOKENS:-65536}
LOSS_WINDOWS=${LOSS_WINDOWS:-8}
export M3C_AUTOTUNE=${M3C_AUTOTUNE:-0}  # the recorded tile configurations: no sweep per new prompt length
mkdir -p "$OUT"
t() { local start=$SECONDS; "$@"; echo "  $((SECONDS - start)) s: ${*:1:4}" >&2; }
model=${MODEL:-$OUT/qwen-b${BLOCK}k${TOPK}}
if [ -z "${MODEL:-}" ]; then
  # calibration ids: the first 4 MB of the calibration text through the model's tokenizer (never the eval text)
  python3 - "$HF/tokenizer.json" "$LONG/long_code_calib.txt" "$OUT/calib_ids.npy" <<'PY'
import sys, numpy as np
from tokenizers import Tokenizer
text = open(sys.argv[2], encoding="utf-8").read(4_000_000)
np.save(sys.argv[3], np.array(Tokenizer.from_file(sys.argv[1]).encode(text).ids, dtype=np.int32))
PY
  t $M3C convert "$HF" "$model" --block-size $BLOCK --topk $TOPK --index-dim 128 --calib "$OUT/calib_ids.npy" \
    --calib-tokens $CT --calib-seq-len 8192 --calib-device "$DEVICE" --force --json >"$OUT/convert.json"
fi
t $M3C eval ruler "$model" --data "$LONG/long_code_eval.txt" --lengths "$LENGTHS" --samples $SAMPLES \
  --selections "$SELECTIONS" --dtype bfloat16 --device "$DEVICE" --json --plot "$OUT/ruler.png" >"$OUT/ruler.json"
if [ "$LOSS_WINDOWS" != 0 ]; then
  for oracle in --no-oracle ""; do
    t $M3C eval loss "$model" --data "$LONG/long_code_eval.txt" --seq-len 32768 --max-windows $LOSS_WINDOWS \
      --dtype bfloat16 --device "$DEVICE" --json $oracle >"$OUT/loss32k${oracle:+-no-oracle}.json"
  done
fi
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
r = json.load(open(f"{out}/ruler.json"))
sel, lengths = r["selections"], [str(n) for n in r["lengths"]]
print(f"ruler: {r['samples']} samples, {r['seconds']:.0f} s; cells: {' / '.join(sel)}")
for t in r["tasks"] + ["average"]:
    rows = r["average"] if t == "average" else r["scores"][t]
    cells = ["/".join(f"{rows[s][n]:.0f}" if rows[s][n] is not None else "-" for s in sel) for n in lengths]
    print(f"  {t + (' (excluded)' if t in r['excluded'] else ''):28s} " + "  ".join(f"{c:>12s}" for c in cells))
for name in ("loss32k-no-oracle", "loss32k"):
    if os.path.exists(f"{out}/{name}.json"):
        e = json.load(open(f"{out}/{name}.json"))
        o = e["oracle_loss_increase"]
        print(f"{name}: dense {e['dense_loss']:.4f} sparse {100 * e['loss_increase']:+.2f}% "
              f"oracle {'-' if o is None else f'{100 * o:+.2f}%'} in {e['seconds']} s")
PY
