#!/usr/bin/env bash
# session 15, call F: the combine of each query chunk on a side stream beside the next chunk's gather (NEW, two
# partial buffers) against HEAD (e6661e3: one buffer, in order): profile and `m3c bench` at G = 4 and M3 shapes, the
# chunked result against one chunk, the whole Llama-3-8B-shaped model at 128K. Results go to $OUT as they come.
R=$PWD; . $R/.carry/setup.sh
HEAD=$R/.carry/head15
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
M="python -m m3compile.cli"
for P in new head; do
  PP=$NEW; [ $P = head ] && PP=$HEAD
  PYTHONPATH=$PP TO=60 t python $X/sparse_attention_profile.py --lengths 131072 --tiles none > $OUT/prof_g4_$P.json 2>/dev/null
  head -c 900 $OUT/prof_g4_$P.json >&2; echo >&2
done
TO=60 t python $R/.carry/check_overlap.py > $OUT/check_overlap.json 2>&1; cat $OUT/check_overlap.json >&2
for S in "32 8 g4" "64 4 m3"; do set -- $S
  TO=90 t $M bench --heads $1 --kv-heads $2 --prefill-lengths 128K --decode-lengths '' --selection independent --no-flex --out $O/b_$3 > $O/bench_$3.log 2>&1
  cp $O/b_$3/bench.json $OUT/bench_$3.json
  python -c "
import json; d = json.load(open('$OUT/bench_$3.json')); r = d['prefill'][0]; s = d['speedups']['prefill'][0]
print('$3', 'attention_ms', round(r['attention_ms'], 3), 'dense', round(r['dense_ms'], 2), 'share', round(s['share_of_ideal'], 4), 'msa_x', round(s['msa_x'], 3), 'fp8_x', round(s['msa_fp8_x'], 3))" >&2
done
TO=150 t $M bench --model llama3-8b --prefill-lengths 128K --decode-lengths '' --steps 3 --index-dim 64 --index-dtype fp8 --out $O/model > $OUT/model.log 2>&1
cp $O/model/*.json $OUT/ 2>/dev/null
grep -h "131,072" $OUT/model.log | head -4 >&2
