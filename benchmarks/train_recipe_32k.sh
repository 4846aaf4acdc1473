#!/usr/bin/env bash
# Sparse continued training on the real 32K model, staged: `m3c train` at 32K (every parameter learns the next-token
# loss through the sparse attention, plus LOSS_COEFF x the index KL) from a converted model whose index branch is
# already distilled, in stages up to the token counts in TOKENS, each resuming the last bit for bit. After each
# stage, under OUT/steps-NNNNNN/ (steps-000000: the model as given):
#     loss32k.json   m3c eval loss at 32K with its oracle row, on held-out long code
#     loss2k.json    m3c eval loss at 2K on the same text, no oracle: short-context quality. At 2K a 128 / 16 budget
#                    holds every key, so its loss is the model's own; steps-000000's dense loss is the source model's
#     ruler.json     the RULER-style suite with the index selection (the RULER_AT stages)
# and OUT/runs.jsonl, one line per training call: steps, tokens, seconds, tokens/s, peak GPU memory. Every file that
# exists is skipped, so the same command called again continues. Each stage evaluates OUT/train, the state of lowest
# held-out loss so far (m3c train's rule). The table (tokens; 32K loss against the source's dense, against the
# stage's own dense, and the oracle's; 2K loss against the source's; the suite's averages; tokens/s and peak memory)
# is printed last and written to OUT/recipe_table.md.
#
#   benchmarks/train_recipe_32k.sh MODEL_DIR LONG_CODE_DIR OUT_DIR
#   MODEL_DIR: a converted, distilled model (e.g. OUT/b128k16/distill of benchmarks/distill_recipe_32k.sh)
#   LONG_CODE_DIR: what `python3 scripts/long_code.py DIR` writes (long_code_calib.txt, long_code_eval.txt)
#   env: TRAIN_DATA (OUT/train_ids.npy: LONG_CODE_DIR's calibration text; a longer text's ids, e.g. what
#        `scripts/long_code.py DIR --calib-bytes 80000000 --exclude LONG_CODE_DIR/long_code_eval.txt` writes, avoid
#        repeating 4.6M tokens), BUDGET (none: the model's stored budget; else `recipe_distill.py budget` options,
#        e.g. "--topk 64 --top-p 0.95 --min-blocks 16": the training runs and the output keeps that budget; the
#        model is then copied to OUT/model), LM_TARGET (data | dense: `m3c train --lm-target`), RECOMPUTE_MLP (0; 1:
#        `m3c train --recompute-mlp`), RULER_OPTS (none: more `m3c eval ruler` options),
#        TOKENS ("0 5M 10M 20M"; K / M / G = 1e3 / 1e6 / 1e9 tokens, rounded up to whole steps), RULER_AT (the
#        TOKENS entries that get the suite; default all; "none": none), SEQ_LEN (32768), BATCH (1), LR (1e-5),
#        LOSS_COEFF (1.0), CHECKPOINT_EVERY (100), SAMPLES (25), LENGTHS (4K,8K,16K,32K), LOSS_WINDOWS (4: 32K windows),
#        SHORT_WINDOWS (64: 2K windows),
#        DEVICE (cuda), M3C (m3c), PY (python3)
set -euo pipefail
MODEL=$1; LONG=$2; OUT=$3
M3C=${M3C:-m3c}; PY=${PY:-python3}; DEVICE=${DEVICE:-cuda}
TOKENS=${TOKENS:-0 5M 10M 20M}; RULER_AT=${RULER_AT:-$TOKENS}; SEQ_LEN=${SEQ_LEN:-32768}; BATCH=${BATCH:-1}
LR=${LR:-1e-5}; LOSS_COEFF=${LOSS_COEFF:-1.0}; CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-100}; SAMPLES=${SAMPLES:-25}
LENGTHS=${LENGTHS:-4K,8K,16K,32K}; LOSS_WINDOWS=${LOSS_WINDOWS:-4}; SHORT_WINDOWS=${SHORT_WINDOWS:-64}
export M3C_AUTOTUNE=${M3C_AUTOTUNE:-0}  # the recorded tile configurations: no sweep per new prompt length
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/_recipe.sh"  # t, to_json, steps_of, wants_ruler
for spec in $TOKENS; do steps_of "$spec" >/dev/null; done  # every count checked before anything is written
mkdir -p "$OUT"

if [ ! -f "$OUT/eval_ids.npy" ]; then  # the token files, through the model's tokenizer
  t $PY "$HERE/recipe_distill.py" prepare "$MODEL" "$LONG/long_code_calib.txt" "$LONG/long_code_eval.txt" "$OUT"
fi
TRAIN_DATA=${TRAIN_DATA:-$OUT/train_ids.npy}
if [ -n "${BUDGET:-}" ]; then  # the model at the budget the training runs at
  [ -d "$OUT/model" ] || t $PY "$HERE/recipe_distill.py" budget "$MODEL" "$OUT/model" $BUDGET
  MODEL=$OUT/model
fi
for spec in $TOKENS; do
  steps=$(steps_of "$spec")
  S=$OUT/steps-$(printf %06d $steps)
  mkdir -p "$S"
  echo "== stage $spec: $steps steps of $BATCH x $SEQ_LEN" >&2
  evaluated=$MODEL
  if [ $steps -gt 0 ]; then
    evaluated=$OUT/train
    if [ ! -f "$S/train.json" ]; then
      t to_json "$S/train.json" $PY "$HERE/recipe_distill.py" train "$MODEL" "$TRAIN_DATA" "$OUT/train" \
        --steps $steps --record "$OUT/runs.jsonl" --seq-len $SEQ_LEN --batch $BATCH --lr $LR \
        --loss-coeff $LOSS_COEFF --lm-target "${LM_TARGET:-data}" --checkpoint-every $CHECKPOINT_EVERY \
        --device "$DEVICE" $([ "${RECOMPUTE_MLP:-0}" = 1 ] && echo --recompute-mlp)
    fi
  fi
  eval_loss() {
    $M3C eval loss "$evaluated" --data "$OUT/eval_ids.npy" --dtype bfloat16 --device "$DEVICE" --json "$@"
  }
  [ -f "$S/loss32k.json" ] || t to_json "$S/loss32k.json" eval_loss --seq-len $SEQ_LEN --max-windows $LOSS_WINDOWS
  [ -f "$S/loss2k.json" ] || t to_json "$S/loss2k.json" eval_loss --seq-len 2048 --max-windows $SHORT_WINDOWS \
    --no-oracle
  if wants_ruler "$spec" && [ ! -f "$S/ruler.json" ]; then
    t to_json "$S/ruler.json" $M3C eval ruler "$evaluated" --data "$LONG/long_code_eval.txt" --lengths "$LENGTHS" \
      --samples $SAMPLES --selections index --dtype bfloat16 --device "$DEVICE" --json ${RULER_OPTS:-}
  fi
done
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
read = lambda p: json.loads(p.read_text()) if p.is_file() else None
runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()] if (out / "runs.jsonl").is_file() else []
stages = sorted(out.glob("steps-*"))
source32, source2 = read(stages[0] / "loss32k.json") or {}, read(stages[0] / "loss2k.json") or {}


def pct(loss, ref):
    return f"{100 * (loss / ref - 1):+.2f}%" if loss is not None and ref else ""


rows = ["| steps | tokens | 32K loss vs the source's dense | vs its own dense | its oracle vs its own dense | "
        "2K loss vs the source's | RULER (index) by length | tokens/s | peak GB |", "| --- " * 9 + "|"]
for s in stages:
    steps = int(s.name.split("-")[1])
    l32, l2, r = read(s / "loss32k.json") or {}, read(s / "loss2k.json") or {}, read(s / "ruler.json") or {}
    run = next((x for x in runs if x["end_step"] == steps), {})
    tokens = steps * runs[0]["seq_len"] * runs[0]["batch"] if runs else 0
    ruler = " / ".join(f"{v:.1f}" for k, v in r.get("average", {}).get("index", {}).items() if k != "all")
    speed = f"{run['tokens_per_s']:,.0f}" if run else ""
    rows.append(f"| {steps} | {tokens:,} | {pct(l32.get('sparse_loss'), source32.get('dense_loss'))} | "
                f"{pct(l32.get('sparse_loss'), l32.get('dense_loss'))} | "
                f"{pct(l32.get('oracle_loss'), l32.get('dense_loss'))} | "
                f"{pct(l2.get('sparse_loss'), source2.get('dense_loss'))} | {ruler} | {speed} | "
                f"{run.get('peak_gb', '')} |")
(out / "recipe_table.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
