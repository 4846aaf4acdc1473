#!/usr/bin/env bash
# The quality-speed frontier on the real 32K model: one row per selection budget of one converted (and distilled)
# Qwen2.5-Coder-0.5B, each with its quality (the 32K loss eval with the oracle row and the blocks each token kept, and
# the RULER-style suite with the index selection) and the speed of the same budget on the llama3-8b preset at 128K
# (whole-model prefill and a decode step at batch 8, at the top-k nearest the mean blocks the real model kept: a
# budget measured, not assumed). Dense once, as the suite's reference row. Then benchmarks/plot_frontier.py OUT
# writes OUT/frontier.md (the table) and OUT/frontier.png (RULER average against decode speed-up).
#
#   benchmarks/frontier_32k.sh MODEL_DIR LONG_CODE_DIR OUT_DIR
#   MODEL_DIR: e.g. OUT/b128k16/distill of benchmarks/distill_recipe_32k.sh (a model with extra dense layers:
#              `m3c convert --dense-costliest N`, then distilled the same way, into another OUT_DIR)
#   LONG_CODE_DIR: what `python3 scripts/long_code.py DIR` writes (long_code_eval.txt: the held-out haystacks)
#   env: BUDGETS ("k16 k32 k64 p0.9:16:64 p0.95:16:64 p0.98:16:64": kN = the fixed top-N; pP:FLOOR:CEILING = the
#        adaptive budget, --top-p P --min-blocks FLOOR --topk CEILING; A+B = A's row with the question and answer at
#        budget B, `m3c eval ruler --answer-budget B`: its loss is A's, its speed A's prefill and B's decode, so it
#        runs no bench of its own (a fixed kN answer without a row is benched into OUT/kN); A+B+C = the same
#        with the answer itself at budget C, `--decode-budget C`: A's prefill, C's decode; C = off: the answer at
#        A's budget, A's decode), SAMPLES (25), LENGTHS (4K,8K,16K,32K),
#        LOSS_WINDOWS (4), SEQ_LEN (32768: the loss eval's windows), SPEED (1; 0 skips the bench), BATCH (8),
#        M3C (m3c), DEVICE (cuda), DENSE (1; 0 leaves the dense row to another call), DENSE_LAYERS (the bench's
#        --dense-layers: 0 to N-1 for MODEL's N dense layers),
#        PARALLEL (1: the quality runs, dense's and each budget's loss and RULER, this many at once on the one GPU,
#        each logging to OUT/<row>.log; the speed benches always run alone, after them. A RULER row at 32K holds
#        17-23 GB on Qwen2.5-Coder-0.5B: 3 rows fit an 80 GB card, a fourth ran out of memory on an H100)
# Every figure is a JSON file: OUT/ruler_dense.json, and per budget OUT/<budget, ':' as '-'>/loss.json, ruler.json,
# speed.json.
# A file that exists is not made again, so the same command called again continues where the last call stopped.
set -euo pipefail
MODEL=$1; LONG=$2; OUT=$3
M3C=${M3C:-m3c}; DEVICE=${DEVICE:-cuda}; SAMPLES=${SAMPLES:-25}; LENGTHS=${LENGTHS:-4K,8K,16K,32K}
BUDGETS=${BUDGETS:-k16 k32 k64 p0.9:16:64 p0.95:16:64 p0.98:16:64}; LOSS_WINDOWS=${LOSS_WINDOWS:-4}
SPEED=${SPEED:-1}; BATCH=${BATCH:-8}; SEQ_LEN=${SEQ_LEN:-32768}
export M3C_AUTOTUNE=${M3C_AUTOTUNE:-0}  # the recorded tile configurations: no sweep per new prompt length
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/_recipe.sh"  # t, to_json
options() {  # a budget's eval options: k16 -> --topk 16 --top-p 1; p0.95:16:64 -> --top-p 0.95 --min-blocks 16 --topk 64
  case $1 in
    *+*) local rest=${1#*+}  # A+B or A+B+C (C may be off: the answer at A's budget): B and C checked, A's options
         options "${rest%%+*}" >/dev/null; [[ $rest != *+* || ${rest#*+} == off ]] || options "${rest#*+}" >/dev/null
         options "${1%%+*}" ;;
    k*) echo "--topk ${1#k} --top-p 1" ;;
    p*) local spec=${1#p}; IFS=: read -r p floor ceiling <<<"$spec"
        echo "--top-p $p --min-blocks ${floor:-0} --topk ${ceiling:?$1: give the ceiling, pP:FLOOR:CEILING}" ;;
    *) echo "error: a budget is kN or pP:FLOOR:CEILING, got $1" >&2; exit 2 ;;
  esac
}
for budget in $BUDGETS; do options "$budget" >/dev/null; done  # every budget checked before anything is written
mkdir -p "$OUT"

ruler() { $M3C eval ruler "$MODEL" --data "$LONG/long_code_eval.txt" --lengths "$LENGTHS" --samples $SAMPLES \
  --dtype bfloat16 --device "$DEVICE" --json "$@"; }
dense_row() { t to_json "$OUT/ruler_dense.json" ruler --selections dense; }
quality() {  # a budget's loss (with its oracle and blocks) and RULER
  local budget=$1 B=$OUT/${1//:/-} opts; mkdir -p "$B"  # p0.95:16:64 -> OUT/p0.95-16-64 (a name a device's copy takes)
  read -r -a opts <<<"$(options "$budget")"
  echo "== $budget: ${opts[*]}" >&2
  [ -f "$B/loss.json" ] || t to_json "$B/loss.json" $M3C eval loss "$MODEL" --data "$LONG/long_code_eval.txt" \
    --seq-len $SEQ_LEN --max-windows $LOSS_WINDOWS --dtype bfloat16 --device "$DEVICE" --json "${opts[@]}"
  local answer=(--answer-budget off) rest=${budget#*+}  # A: none (not even the model's stored one); A+B: B;
  [[ $budget == *+* ]] && answer=(--answer-budget "${rest%%+*}")  # A+B+C: B, and --decode-budget C
  [[ $rest == *+* ]] && answer+=(--decode-budget "${rest#*+}")
  [ -f "$B/ruler.json" ] || t to_json "$B/ruler.json" ruler --selections index "${opts[@]}" "${answer[@]}"
}
rows=()  # the quality runs still to make
[ "${DENSE:-1}" = 0 ] || [ -f "$OUT/ruler_dense.json" ] || rows+=("dense_row")
for budget in $BUDGETS; do
  [ -f "$OUT/${budget//:/-}/loss.json" ] && [ -f "$OUT/${budget//:/-}/ruler.json" ] || rows+=("quality $budget")
done
failed=0
if [ "${PARALLEL:-1}" -le 1 ]; then
  for row in ${rows[@]+"${rows[@]}"}; do $row; done
else  # at most PARALLEL at once; each row's messages in its own log
  running=0
  for row in ${rows[@]+"${rows[@]}"}; do
    if [ $running -ge "$PARALLEL" ]; then wait -n || failed=1; running=$((running - 1)); fi
    name=${row#quality }; $row 2>"$OUT/${name//:/-}.log" & running=$((running + 1))
  done
  while [ $running -gt 0 ]; do wait -n || failed=1; running=$((running - 1)); done
  [ $failed = 0 ] || { echo "error: a quality run failed (its log: OUT/<row>.log)" >&2; exit 1; }
fi
bench() {  # bench FOLDER TOPK: the llama3-8b preset at 128K at that top-k -> FOLDER/speed.json
  # the preset keeps as many layers dense as MODEL does (layers 0 to N-1: the count is what its speed depends on)
  DENSE_LAYERS=${DENSE_LAYERS:-$(python3 -c "import json, sys
freq = json.load(open(sys.argv[1]))['sparse_attention_config']['sparse_attention_freq']
print(','.join(str(i) for i in range(freq.count(0))))" "$MODEL/config.json")}
  t $M3C bench model llama3-8b --index-dim 64 --index-dtype fp8 --kv-cache fp8 --topk "$2" \
    --dense-layers "$DENSE_LAYERS" --prefill-lengths 128K --decode-lengths 128K --batch $BATCH --steps 3 \
    --profile-max 8K --out "$1/bench" >&2
  cp "$1/bench/llama3-8b.json" "$1/speed.json"
}
for budget in $BUDGETS; do
  B=$OUT/${budget//:/-}
  [ "$SPEED" = 1 ] || continue
  if [ ! -f "$B/speed.json" ] && [[ $budget != *+* ]]; then
    bench "$B" "$(python3 -c "import json, sys; print(max(1, round(json.load(open(sys.argv[1]))['mean_blocks'])))" \
      "$B/loss.json")"
  elif [[ $budget == *+* ]]; then  # the answer's row: a fixed kN with no row of its own is benched at N (OUT/kN)
    rest=${budget#*+}; answer=${rest##*+}
    if [[ $answer == k* ]] && [ ! -f "$OUT/$answer/speed.json" ]; then
      mkdir -p "$OUT/$answer"; bench "$OUT/$answer" "${answer#k}"
    fi
  fi
done
[ ! -f "$OUT/ruler_dense.json" ] || python3 "$HERE/plot_frontier.py" "$OUT"
