#!/usr/bin/env bash
# session 15, call C: OLD (c255270) against NEW (payload and first token two tiles ahead in gather-Q; the combine's
# warps by program size): profile and `m3c bench` shares at G = 4 / 7 / 16, full-size checks, the whole
# Llama-3-8B-shaped model at 128K
R=$PWD; . $R/.carry/setup.sh
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
M="python -m m3compile.cli"
TO=150 t python $R/benchmarks/check_kernels.py --only sparse --json $O/check_sparse.json > $O/check_sparse.log 2>&1
for P in old new; do
  PP=$NEW; [ $P = old ] && PP=$OLD; export PYTHONPATH=$PP
  for S in "32 8 g4" "28 4 g7" "64 4 m3"; do set -- $S
    t python $X/sparse_attention_profile.py --lengths 131072 --heads $1 --kv-heads $2 --tiles none > $O/prof_$3_$P.json 2>/dev/null
    TO=100 t $M bench --heads $1 --kv-heads $2 --prefill-lengths 128K --decode-lengths '' --selection independent --no-flex --out $O/b_$3_$P > $O/bench_$3_$P.log 2>&1
    cp $O/b_$3_$P/bench.json $O/bench_$3_$P.json
  done
done
export PYTHONPATH=$NEW
TO=200 t $M bench --model llama3-8b --prefill-lengths 128K --decode-lengths '' --steps 3 --index-dim 64 --index-dtype fp8 --out $O/model128k > $O/model128k.log 2>&1
for f in $O/model128k/*.json; do cp $f $O/model128k_$(basename $f); done
tail -n 30 $O/check_sparse.log >&2
python - <<'PY' >&2
import json, glob
for f in sorted(glob.glob('/tmp/r/prof_*.json')):
    try:
        d = json.loads(open(f).readline()); r = d['rows'][0] if 'rows' in d else d
        print(f.split('/')[-1], r['ms'], r['gather_stage_ms'], r['share_of_ideal'], [k[:2] for k in r['kernels'][:3]])
    except Exception as e:
        print(f, 'ERR', e)
PY
grep -h "share\|sparse\|G=" $O/bench_*.log | head -40 >&2
grep -h "131,072\|128K\|x$" $O/model128k.log | head >&2
tar -czf $OUT/s15c.tgz -C $O --exclude='b_*' --exclude=model128k .
