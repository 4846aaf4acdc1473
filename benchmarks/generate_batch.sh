#!/usr/bin/env bash
# m3c generate with a batch of prompts against one prompt: new tokens per second of the decode (every prompt's new
# tokens over the decode seconds, --timings' new_tokens_per_s), one prompt and N prompts of the same size alternating,
# after a first run of each that compiles the kernels. Prints one JSON on stdout: every run's timings, the medians
# and batch / one.
#
#   benchmarks/generate_batch.sh MODEL_DIR TEXT_FILE [more m3c generate options, e.g. --dtype bfloat16]
#   env: M3C (m3c), DEVICE (cuda), N (8 prompts), CHARS (74000 characters a prompt: about 16K tokens of Python for
#        Qwen2.5-Coder's tokenizer), NEW_TOKENS (64), REPEATS (2 timed runs of each), OUT (a new temporary folder)
# The prompts are consecutive slices of TEXT_FILE (data/long_code_eval.txt of scripts/long_code.py), the single
# prompt the first of them. The 32K code model, 8 prompts of 16K tokens:
#   benchmarks/generate_batch.sh qwen-msa data/long_code_eval.txt --dtype bfloat16 > batch.json
set -euo pipefail
MODEL=$1; TEXT=$2; shift 2
M3C=${M3C:-m3c}; DEVICE=${DEVICE:-cuda}; N=${N:-8}; CHARS=${CHARS:-74000}; NEW=${NEW_TOKENS:-64}
REPEATS=${REPEATS:-2}; OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
python3 - "$TEXT" "$N" "$CHARS" "$OUT" <<'PY'
import json, sys
text, n, chars, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
body = open(text, encoding="utf-8").read()
if len(body) < n * chars:
    sys.exit(f"error: {text} holds {len(body):,} characters; {n} prompts of {chars:,} need {n * chars:,}")
prompts = [body[i * chars:(i + 1) * chars] for i in range(n)]
with open(f"{out}/batch.jsonl", "w") as f:
    f.writelines(json.dumps(p) + "\n" for p in prompts)
with open(f"{out}/one.jsonl", "w") as f:
    f.write(json.dumps(prompts[0]) + "\n")
PY
runs=()
for i in $(seq 0 "$REPEATS"); do  # run 0 of each compiles its kernels and is not counted
  for kind in one batch; do
    $M3C generate "$MODEL" --prompts-jsonl "$OUT/$kind.jsonl" --max-new-tokens "$NEW" --device "$DEVICE" --json \
      --timings "$@" >"$OUT/$kind-$i.jsonl" 2>"$OUT/$kind-$i.err"
    runs+=("$kind $i $OUT/$kind-$i.err")
    echo "$kind-$i done" >&2
  done
done
printf '%s\n' "${runs[@]}" | python3 -c '
import json, statistics, sys
runs = []
for line in sys.stdin.read().split("\n"):
    if line:
        kind, i, err = line.split(" ", 2)
        timings = json.loads(open(err).read().strip().splitlines()[-1])
        runs.append({"prompts": kind, "run": int(i), "timings": timings})
med = {k: statistics.median(r["timings"]["new_tokens_per_s"] for r in runs if r["prompts"] == k and r["run"] > 0)
       for k in ("one", "batch")}
batch = next(r["timings"]["batch"] for r in runs if r["prompts"] == "batch")
print(json.dumps({"runs": runs, "summary": {"batch": batch, "new_tokens_per_s": med,
                                            "batch_over_one": round(med["batch"] / med["one"], 3)}}, indent=1))
'
