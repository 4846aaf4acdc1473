#!/usr/bin/env bash
# session 15, call E: the final code: `m3c bench` shares at G = 4 and at M3 shapes, the whole Llama-3-8B-shaped model
# at 128K and 512K (extrapolated)
R=$PWD; . $R/.carry/setup.sh
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
M="python -m m3compile.cli"
for S in "32 8 g4" "64 4 m3"; do set -- $S
  TO=100 t $M bench --heads $1 --kv-heads $2 --prefill-lengths 128K --decode-lengths '' --selection independent --no-flex --out $O/b_$3 > $O/bench_$3.log 2>&1
  cp $O/b_$3/bench.json $O/bench_$3.json
done
TO=240 t $M bench --model llama3-8b --prefill-lengths 128K,512K --decode-lengths '' --steps 3 --index-dim 64 --index-dtype fp8 --index-cache fp8 --out $O/model > $O/model.log 2>&1
for f in $O/model/*; do cp $f $O/model_$(basename $f); done
python - <<'PY' >&2
import json
for n in ('g4', 'm3'):
    d = json.load(open(f'/tmp/r/bench_{n}.json')); r = d['prefill'][0]; s = d['speedups']['prefill'][0]
    print(n, 'attention_ms', round(r['attention_ms'], 3), 'dense', round(r['dense_ms'], 2), 'share', round(s['share_of_ideal'], 4), 'msa_x', round(s['msa_x'], 3), 'fp8_x', round(s['msa_fp8_x'], 3))
PY
grep -h "131,072\|524,288" $O/model.log | head >&2
tar -czf $OUT/s15e.tgz -C $O --exclude='b_*' --exclude=model .
