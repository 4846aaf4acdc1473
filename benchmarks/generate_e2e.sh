#!/usr/bin/env bash
# m3c generate end to end, dense against converted, as users run it: each run's wall time (process start to exit)
# and its --timings breakdown (import, load, tokenize, setup, cache, prefill, graph_capture, decode, release,
# output, untimed, Triton compiles and kernel variants), on a first run (an empty TRITON_CACHE_DIR) and warm runs
# (the same cache again). Prints one JSON on stdout: every run, then per model the cold and median warm wall times
# and the MSA / dense ratios.
#
#   benchmarks/generate_e2e.sh DENSE_DIR MSA_DIR PROMPT_FILE [more m3c generate options, e.g. --dtype bfloat16]
#   env: M3C (m3c), DEVICE (cuda), NEW_TOKENS (64), RUNS ("cold warm warm warm warm": in order, each run of the dense
#        model then of the converted one; cold empties the model's Triton cache first), OUT (a new temporary folder: each run's text, stderr and Triton cache)
# Before the runs, torch is imported once and both checkpoints are read once, so that "cold" means a cold kernel
# cache, not a cold file-system cache. The 32K code model of scripts/qwen25_coder.py with a 25K-token
# prompt (about 2.5 minutes on an H200):
#   python3 scripts/qwen25_coder.py qwen && m3c convert qwen qwen-msa --index-dim 128
#   python3 scripts/long_code.py data && python3 -c "open('prompt.txt', 'w').write(open('data/long_code_eval.txt').read()[:92000])"
#   benchmarks/generate_e2e.sh qwen qwen-msa prompt.txt > e2e.json
set -euo pipefail
DENSE=$1; MSA=$2; PROMPT=$3; shift 3
M3C=${M3C:-m3c}; DEVICE=${DEVICE:-cuda}; NEW=${NEW_TOKENS:-64}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
python3 -c "import torch" && cat "$DENSE"/*.safetensors "$MSA"/*.safetensors >/dev/null
runs=()
i=0
for run in ${RUNS:-cold warm warm warm warm}; do  # the two models alternate, so a drift of the machine hits both
  i=$((i + 1))
  for model in dense msa; do
    dir=$DENSE; [ $model = msa ] && dir=$MSA
    cache=$OUT/triton-cache-$model
    tag=$model-$i-$run
    if [ $run = cold ]; then rm -rf "$cache"; fi
    mkdir -p "$cache"
    start=$(date +%s.%N)
    TRITON_CACHE_DIR=$cache $M3C generate "$dir" --prompt-file "$PROMPT" --max-new-tokens "$NEW" --device "$DEVICE" \
      --timings "$@" >"$OUT/$tag.txt" 2>"$OUT/$tag.err"
    end=$(date +%s.%N)
    runs+=("$model $run $start $end $OUT/$tag.err")
    echo "$tag: $(python3 -c "print(round($end - $start, 1))") s" >&2
  done
done
printf '%s\n' "${runs[@]}" | python3 -c '
import json, statistics, sys
rows = []
for line in sys.stdin.read().splitlines():
    model, run, start, end, err = line.split(" ", 4)
    last = open(err).read().strip().splitlines()[-1]
    rows.append({"model": model, "run": run, "wall_s": round(float(end) - float(start), 3), "timings": json.loads(last)})
summary = {}
for model in ("dense", "msa"):
    cold = [r["wall_s"] for r in rows if r["model"] == model and r["run"] == "cold"]
    warm = [r["wall_s"] for r in rows if r["model"] == model and r["run"] == "warm"]
    summary[model] = {"cold_s": cold[0] if cold else None, "warm_s": statistics.median(warm) if warm else None}
ratio = lambda k: (summary["msa"][k] / summary["dense"][k]) if summary["msa"][k] and summary["dense"][k] else None
summary["msa_over_dense_cold"], summary["msa_over_dense_warm"] = ratio("cold_s"), ratio("warm_s")
print(json.dumps({"runs": rows, "summary": summary}, indent=2))
'
