#!/usr/bin/env bash
# session 17, call G: the fp8 index cache's decode selection with its own M3C_AUTOTUNE=0 tile (NPG 1, PPP 4, 3
# stages, the 2026-11-29 sweep's choice) instead of the bf16 cache's, at M3's shapes, batch 8, 512K and 1M
R=$PWD; . $R/benchmarks/results/2026-12-02-h200-session16/setup.sh
TO=200 t python -m m3compile.cli bench --heads 64 --kv-heads 4 --index-dim 128 --block 128 --topk 16 --prefill-lengths '' --decode-lengths 32K,128K,512K,1M --batch 8 --selection independent --no-flex --out $O/dec > $O/dec.log 2>&1
cp $O/dec/bench.json $OUT/bench_decode.json; cp $O/dec.log $OUT/
python -c "
import json; d=json.load(open('/tmp/r/dec/bench.json'))
for r, s in zip(d['decode'], d['speedups']['decode']): print(s['T'], 'select_fp8_ms', round(r['select_fp8_ms'], 4), 'bf16_x', round(s['bf16_x'], 2), 'fp8_x', round(s['fp8_x'], 2))" >&2
