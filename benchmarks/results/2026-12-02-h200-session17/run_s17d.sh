#!/usr/bin/env bash
# session 17, call D: L2 cache hints (l2_hints.diff): the gather kernel's Q-row loads evict_last (each row is read
# once per selected block; the partial stores stream 17 GB through L2 past them), the combine's partial loads
# evict_first (read once). Production against the hints in one call, `m3c bench` at G = 4 and M3's G = 16, 128K,
# each with query chunks of 32K and 48K tokens (Q rows of one head: 32 / 48 MB at G = 4)
R=$PWD; . $R/benchmarks/results/2026-12-02-h200-session16/setup.sh
rm -rf /tmp/pkg_var && cp -r /tmp/pkg_new /tmp/pkg_var && rm /tmp/pkg_var/m3compile/kernels && cp -r $R/kernels /tmp/pkg_var/m3compile/kernels
(cd /tmp/pkg_var/m3compile && (patch -p1 < $R/benchmarks/results/2026-12-02-h200-session17/l2_hints.diff || git apply -p1 $R/benchmarks/results/2026-12-02-h200-session17/l2_hints.diff)) >&2
grep -c evict_ /tmp/pkg_var/m3compile/kernels/_tl_sparse.py >&2
for S in "32 8 g4" "64 4 m3"; do set -- $S
  for v in base hints; do
    P=$([ $v = base ] && echo /tmp/pkg_new || echo /tmp/pkg_var)
    TO=150 PYTHONPATH=$P t python -m m3compile.cli bench --heads $1 --kv-heads $2 --prefill-lengths 128K --decode-lengths '' --selection independent --no-flex --query-chunk-sweep 32K,48K --out $O/b_$3_$v > $O/bench_$3_$v.log 2>&1
    cp $O/b_$3_$v/bench.json $O/bench_$3_$v.json
  done
done
python - <<'PY' >&2
import json
for n in ('g4', 'm3'):
    for v in ('base', 'hints'):
        try:
            d = json.load(open(f'/tmp/r/bench_{n}_{v}.json')); r = d['prefill'][0]; s = d['speedups']['prefill'][0]
            print(n, v, 'attention_ms', round(r['attention_ms'], 3), 'dense', round(r['dense_ms'], 2), 'share', round(s['share_of_ideal'], 4), 'gather_ms', round(r['gather_ms'], 3))
            for qc, ms in r['query_chunk_ms'].items(): print('   chunk', qc, round(ms, 3), 'share', round(r['dense_ms'] / ms / r['ideal'], 4))
        except Exception as e: print(n, v, 'ERR', repr(e)[:200])
PY
tar -czf $OUT/s17d.tgz -C $O --exclude='b_*' .
