#!/usr/bin/env bash
# The 32K distillation recipe on the real 32K-context model, staged: Qwen2.5-Coder-0.5B-Instruct (as
# scripts/qwen25_coder.py builds it) converted at one budget (BLOCK / TOPK) with a 128-wide index head
# calibrated on long code (as benchmarks/ruler_real.sh), then distilled at 32K in stages up to the token counts in
# TOKENS, each stage resuming the last (`m3c distill --resume` semantics: bit for bit, the same data order), and after
# each stage evaluated: the 32K loss eval with its oracle row on held-out long code (`m3c eval --seq-len 32768
# --max-windows LOSS_WINDOWS`) and the RULER-style suite with the MSA selection only, at LENGTHS with SAMPLES samples.
# Every figure is a JSON file under OUT/b{BLOCK}k{TOPK}[-TAG]/:
#     convert.json                      the conversion report
#     runs.jsonl                        one line per distillation call: steps, tokens, seconds, tokens/s, peak GB
#     steps-NNNNNN/distill.json         the run report (without its per-step history) when the stage was reached
#     steps-NNNNNN/loss.json            m3c eval loss --json (dense, sparse and oracle loss, recall)
#     steps-NNNNNN/ruler.json           m3c eval ruler --selections index --json
# steps-000000 is the calibrated init (a "0" in TOKENS). Every step whose JSON exists is skipped, so the same command
# called again continues where the last call stopped: with DEADLINE (seconds), the script stops by itself before it
# (a distillation is sent SIGINT SAVE_MARGIN seconds before, finishes its step and saves its state; an eval is not
# started without EST_LOSS / EST_RULER seconds left) and exits 0 saying what is left. Then
# `python3 benchmarks/plot_recipe.py OUT` draws every budget found in OUT and prints the table.
#
#   benchmarks/distill_recipe_32k.sh HF_QWEN_DIR LONG_CODE_DIR OUT_DIR
#   LONG_CODE_DIR: what `python3 scripts/long_code.py DIR` writes (long_code_calib.txt, long_code_eval.txt)
#   env: BLOCK (128), TOPK (16), TOKENS ("0 4M 12M 25M 50M"; K / M / G = 1e3 / 1e6 / 1e9 tokens, rounded up to whole
#        steps), RULER_AT (the TOKENS entries that get the RULER eval; default all), SEQ_LEN (32768), BATCH (1),
#        LR (1e-3), LR_SCHEDULE (constant | cosine), LR_WARMUP (0: steps of linear ramp), LR_MIN (0.1: the cosine's
#        floor, a fraction of LR; the cosine ends at the last TOKENS entry's step), TAG (none: a name appended to the
#        budget's folder, to compare recipes), WARMUP_STEPS (0), CHECKPOINT_EVERY (250: held-out evaluation and
#        checkpoint), HOLDOUT_TOKENS (m3c distill's default: 4 windows), BLOCK_LOSS (1), CUDA_GRAPH (0), LOSS_WINDOWS (8), SAMPLES (5),
#        LENGTHS (4K,8K,16K,32K), TASKS (all), EVAL_DTYPE (bfloat16), DEVICE (cuda), CALIB_TOKENS (65536),
#        CALIB_SEQ_LEN (8192), INDEX_DIM (128), TRAIN_CHARS (0: the whole calibration text), DEADLINE (none),
#        SAVE_MARGIN (30), EST_LOSS (45), EST_RULER (120), M3C (m3c), PY (python3), CONVERT_OPTS (none: more
#        `m3c convert` options, with a TAG: "--dense-costliest 2" keeps the 2 layers costliest alone sparse dense too,
#        "--topk 64 --top-p 0.95 --min-blocks 16" distils on the adaptive budget's blocks)
# On one H200, at the 59K tokens/s measured for 128 / 16 at 32K (3.9M tokens in 67 s), a stage of N million tokens
# takes about 17 N seconds of steps; a loss eval of 8 windows about 20 s, a RULER eval (MSA only, 5 samples) about
# 70 s, the token files 20 s and the conversion 16 s, once.
set -euo pipefail
HF=$1; LONG=$2; OUT=$3
M3C=${M3C:-m3c}; PY=${PY:-python3}; DEVICE=${DEVICE:-cuda}
BLOCK=${BLOCK:-128}; TOPK=${TOPK:-16}; TOKENS=${TOKENS:-0 4M 12M 25M 50M}; RULER_AT=${RULER_AT:-$TOKENS}
SEQ_LEN=${SEQ_LEN:-32768}; BATCH=${BATCH:-1}; LR=${LR:-1e-3}; WARMUP_STEPS=${WARMUP_STEPS:-0}
LR_SCHEDULE=${LR_SCHEDULE:-constant}; LR_WARMUP=${LR_WARMUP:-0}; LR_MIN=${LR_MIN:-0.1}; TAG=${TAG:-}
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-250}; BLOCK_LOSS=${BLOCK_LOSS:-1}; CUDA_GRAPH=${CUDA_GRAPH:-0}
LOSS_WINDOWS=${LOSS_WINDOWS:-8}; SAMPLES=${SAMPLES:-5}; LENGTHS=${LENGTHS:-4K,8K,16K,32K}; TASKS=${TASKS:-}
EVAL_DTYPE=${EVAL_DTYPE:-bfloat16}; CALIB_TOKENS=${CALIB_TOKENS:-65536}; CALIB_SEQ_LEN=${CALIB_SEQ_LEN:-8192}
INDEX_DIM=${INDEX_DIM:-128}; TRAIN_CHARS=${TRAIN_CHARS:-0}; DEADLINE=${DEADLINE:-}
SAVE_MARGIN=${SAVE_MARGIN:-30}; EST_LOSS=${EST_LOSS:-45}; EST_RULER=${EST_RULER:-120}
export M3C_AUTOTUNE=${M3C_AUTOTUNE:-0}  # the recorded tile configurations: no sweep per new prompt length
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/_recipe.sh"  # t, to_json, steps_of, wants_ruler
B=$OUT/b${BLOCK}k${TOPK}${TAG:+-$TAG}
mkdir -p "$B"

left() { [ -n "$DEADLINE" ] && echo $((DEADLINE - SECONDS)) || echo 999999; }
stop_for_time() { echo "== out of time ($(left) s left of DEADLINE $DEADLINE): call again to continue at $1" >&2; exit 0; }
state_step() { [ -f "$B/distill/distill_state/state.json" ] && $PY -c \
  "import json, sys; print(json.load(open(sys.argv[1]))['step'])" "$B/distill/distill_state/state.json" || echo 0; }

# the token files, once per OUT (shared by the budgets)
if [ ! -f "$OUT/eval_ids.npy" ]; then
  t $PY "$HERE/recipe_distill.py" prepare "$HF" "$LONG/long_code_calib.txt" "$LONG/long_code_eval.txt" \
    "$OUT" --train-chars "$TRAIN_CHARS"
fi
model=$B/model
if [ ! -f "$B/convert.json" ]; then
  t to_json "$B/convert.json" $M3C convert "$HF" "$model" --block-size $BLOCK --topk $TOPK --index-dim $INDEX_DIM \
    --calib "$OUT/calib_ids.npy" --calib-tokens $CALIB_TOKENS --calib-seq-len $CALIB_SEQ_LEN --calib-device "$DEVICE" \
    ${CONVERT_OPTS:-} --force --json
fi

last_steps=0  # the cosine ends at the last stage: every stage's call names the same curve
for spec in $TOKENS; do last_steps=$(steps_of "$spec"); done
schedule=(--lr-schedule $LR_SCHEDULE --lr-warmup $LR_WARMUP)  # the floor and the decay shape the cosine alone
if [ "$LR_SCHEDULE" = cosine ]; then schedule+=(--lr-min $LR_MIN --lr-decay-steps $last_steps); fi

for spec in $TOKENS; do
  steps=$(steps_of "$spec")
  S=$B/steps-$(printf %06d $steps)
  mkdir -p "$S"
  echo "== $B: stage $spec = $steps steps of $BATCH x $SEQ_LEN ($((steps * SEQ_LEN * BATCH)) tokens)" >&2
  evaluated=$model
  if [ $steps -gt 0 ]; then
    evaluated=$B/distill
    if [ ! -f "$S/distill.json" ]; then
      now=$(state_step)
      if [ "$now" -gt $steps ]; then
        echo "  the run is at step $now, past this stage: its figures were not taken (skipped)" >&2; continue
      fi
      limit=$(( $(left) - SAVE_MARGIN ))
      [ $limit -ge 60 ] || stop_for_time "distillation to $steps steps (now $now)"
      rc=0
      timeout -s INT --preserve-status -k 60 $limit $PY "$HERE/recipe_distill.py" distill "$model" \
        "$OUT/train_ids.npy" "$B/distill" --steps $steps --record "$B/runs.jsonl" --seq-len $SEQ_LEN --batch $BATCH \
        --lr $LR "${schedule[@]}" --warmup-steps $WARMUP_STEPS --checkpoint-every $CHECKPOINT_EVERY \
        --block-loss $BLOCK_LOSS \
        --device "$DEVICE" ${HOLDOUT_TOKENS:+--holdout-tokens $HOLDOUT_TOKENS} \
        $([ "$CUDA_GRAPH" = 1 ] && echo --cuda-graph) >"$S/distill.json.part" || rc=$?
      if [ $rc = 3 ]; then stop_for_time "distillation to $steps steps (now $(state_step))"; fi
      [ $rc = 0 ] || { echo "error: the distillation exited $rc" >&2; exit $rc; }
      mv "$S/distill.json.part" "$S/distill.json"
    elif [ "$(state_step)" -ne $steps ]; then
      if [ ! -f "$S/loss.json" ] || { wants_ruler "$spec" && [ ! -f "$S/ruler.json" ]; }; then
        echo "  the run is at step $(state_step), past this stage: its missing evals are skipped" >&2
      fi
      continue
    fi
  fi
  if [ "$LOSS_WINDOWS" != 0 ] && [ ! -f "$S/loss.json" ]; then
    [ $(left) -ge $EST_LOSS ] || stop_for_time "the loss eval of $spec"
    t to_json "$S/loss.json" $M3C eval loss "$evaluated" --data "$OUT/eval_ids.npy" --seq-len $SEQ_LEN \
      --max-windows $LOSS_WINDOWS --dtype $EVAL_DTYPE --device "$DEVICE" --json
  fi
  if wants_ruler "$spec" && [ ! -f "$S/ruler.json" ]; then
    [ $(left) -ge $EST_RULER ] || stop_for_time "the RULER eval of $spec"
    t to_json "$S/ruler.json" $M3C eval ruler "$evaluated" --data "$LONG/long_code_eval.txt" \
      --lengths "$LENGTHS" --samples $SAMPLES --selections index ${TASKS:+--tasks $TASKS} --dtype $EVAL_DTYPE \
      --device "$DEVICE" --json
  fi
done
echo "== $B: every stage of TOKENS=\"$TOKENS\" done ($SECONDS s in this call)" >&2
