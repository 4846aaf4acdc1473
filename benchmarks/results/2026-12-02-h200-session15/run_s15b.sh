#!/usr/bin/env bash
# session 15, call B: gather-Q with the payload two tiles ahead (NEW = the working tree), and with a carried scalar
# first-token test too (NEW2 = .carry/new2), against OLD (c255270) at G = 4, 7, 16; the combine at 1-8 warps again
R=$PWD; . $R/.carry/setup.sh
NEW2=$R/.carry/new2
for S in "32 8 g4" "28 4 g7" "64 4 g16"; do set -- $S
  for P in new old new2; do
    PP=$NEW; [ $P = old ] && PP=$OLD; [ $P = new2 ] && PP=$NEW2
    PYTHONPATH=$PP timeout 90 python $X/sparse_attention_profile.py --lengths 131072 --heads $1 --kv-heads $2 --tiles none > $O/prof_${3}_$P.json 2>$O/err_${3}_$P.txt
  done
done
for S in "32 8 g4" "28 4 g7" "64 4 g16"; do set -- $S
  timeout 90 python $X/combine_config.py --heads $1 --kv-heads $2 > $O/combine_$3.log 2>&1
done
python - <<'PY' >&2
import json, glob
for f in sorted(glob.glob('/tmp/r/prof_*.json')):
    try:
        d = json.loads(open(f).readline()); r = d['rows'][0] if 'rows' in d else d
        print(f.split('/')[-1], r['ms'], r['gather_stage_ms'], r['share_of_ideal'], [k[:2] for k in r['kernels'][:2]])
    except Exception as e:
        print(f, 'ERR', e, open(f.replace('prof_', 'err_').replace('.json', '.txt')).read()[-800:])
for f in sorted(glob.glob('/tmp/r/combine_*.log')):
    print(f.split('/')[-1], [(d['num_warps'], round(d['ms'], 3)) for d in map(json.loads, (l for l in open(f) if l.startswith('{')))])
PY
tar -czf $OUT/s15b.tgz -C $O .
