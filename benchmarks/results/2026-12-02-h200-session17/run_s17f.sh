#!/usr/bin/env bash
# session 17, call F: the README headline's prefill panel with today's code: `m3c bench` at M3's attention shapes
# (64 / 4 heads, block 128, top-16, index dim 128), 8K-1M, the independent selection (the panel's), dense measured
# to 128K and extrapolated past it as the 2026-11-29 run that the panel drew until now
R=$PWD; . $R/benchmarks/results/2026-12-02-h200-session16/setup.sh
TO=420 t python -m m3compile.cli bench --heads 64 --kv-heads 4 --index-dim 128 --block 128 --topk 16 --prefill-lengths 8K,32K,128K,512K,1M --decode-lengths '' --selection independent --no-flex --out $O/m3 > $O/m3.log 2>&1
cp $O/m3/bench.json $OUT/bench.json; cp $O/m3.log $OUT/
grep -E "prefill T=" $O/m3.log | head -12 >&2
python - <<'PY' >&2
import json
d = json.load(open('/tmp/r/m3/bench.json'))
for s in d['speedups']['prefill']: print(s['T'], 'msa_x', round(s['msa_x'], 2), 'attention_x', round(s['attention_x'], 2), 'share', round(s['share_of_ideal'], 3))
PY
# then, on the same warm machine (a second `run` call; the fp8 selection here still ran the bf16 cache's tile under
# M3C_AUTOTUNE=0, which call G fixes):
#   TO=250 t python -m m3compile.cli bench --heads 64 --kv-heads 4 --index-dim 128 --block 128 --topk 16 \
#       --prefill-lengths '' --decode-lengths 32K,128K,512K,1M --batch 8 --selection independent --no-flex --out $O/dec
