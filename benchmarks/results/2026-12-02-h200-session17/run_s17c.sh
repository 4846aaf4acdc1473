#!/usr/bin/env bash
# session 17, call C: do query chunks whose gathered Q rows fit in L2 pay now? `m3c bench --query-chunk-sweep` at
# G = 4 (Llama-3-8B), G = 7 (Qwen2.5-7B) and G = 16 (M3), 128K: one head's Q rows of a chunk of C tokens are C x G x
# 256 bytes (G = 4: 8-48 MB for 8K-48K tokens; the H200's L2 holds 50 MB), each read once per selected block
R=$PWD; . $R/benchmarks/results/2026-12-02-h200-session16/setup.sh
for S in "32 8 g4" "28 4 g7" "64 4 m3"; do set -- $S
  TO=200 t python -m m3compile.cli bench --heads $1 --kv-heads $2 --prefill-lengths 128K --decode-lengths '' --selection independent --no-flex --query-chunk-sweep 8K,16K,24K,32K,48K --out $O/b_$3 > $O/bench_$3.log 2>&1
  cp $O/b_$3/bench.json $O/bench_$3.json
done
python - <<'PY' >&2
import json
for n in ('g4', 'g7', 'm3'):
    try:
        d = json.load(open(f'/tmp/r/bench_{n}.json')); r = d['prefill'][0]; s = d['speedups']['prefill'][0]
        print(n, 'attention_ms', round(r['attention_ms'], 3), 'dense', round(r['dense_ms'], 2), 'share', round(s['share_of_ideal'], 4), 'ideal', round(r['ideal'], 3))
        for qc, ms in r['query_chunk_ms'].items(): print('   chunk', qc, round(ms, 3), 'share', round(r['dense_ms'] / ms / r['ideal'], 4))
    except Exception as e: print(n, 'ERR', repr(e)[:200])
PY
tar -czf $OUT/s17c.tgz -C $O --exclude='b_*' .
