#!/usr/bin/env bash
# session 16, call A: where G = 4's sparse attention at 128K spends its time beyond its kernels, and the levers
# (g4_levers.py: balanced / single query chunk, 4096 rows per program, the local block removed, the CSR alone,
# host gaps in a timeline); gather_variants' ahead (production) against ahead_lsetma (log-sum-exps by TMA)
R=$PWD; . $R/benchmarks/results/2026-12-02-h200-session16/setup.sh
TO=240 t python $X/g4_levers.py > $O/levers_g4.json 2> $O/levers_g4.log
TO=150 t python $X/gather_variants.py --variants entry_tma,ahead,ahead_lsetma > $O/variants_g4.json 2> $O/variants_g4.log
TO=150 t python $X/g4_levers.py --heads 28 --kv-heads 4 --skip graph,one_chunk > $O/levers_g7.json 2> $O/levers_g7.log
grep -h RESULT $O/levers_g4.json | cut -c8- | python -c "
import json,sys; d=json.load(sys.stdin)
for n,r in d['rows'].items(): print(n, r)
print('share', d.get('share_of_ideal')); print('local_share', d['local_share'], 'chunks', d['chunks'])
for k in ('timeline_all','timeline_csr'): print(k, json.dumps(d[k])[:1500])" >&2
grep -v RESULT $O/variants_g4.json >&2
grep -h '^{' $O/levers_g7.json >&2
cp $O/* $OUT/ 2>/dev/null
