#!/usr/bin/env bash
# session 16, call D: FORWARD_CHUNK_ROWS 2048 (default) against 4096 in one call: `m3c bench` share at G = 4
# (128K; G = 7 and 16 left out for device time) and the distillation rows of `m3c bench --distill smollm2-135m` (the fused KL walks the forward's CSR at
# that chunk)
R=$PWD; . $R/benchmarks/results/2026-12-02-h200-session16/setup.sh
cat > /tmp/m3c_rows <<'X'
#!/usr/bin/env bash
rows=$1; shift
exec python -c "import sys; import m3compile.kernels.sparse_attention as sa; sa.FORWARD_CHUNK_ROWS = $rows; sys.argv = ['m3c'] + sys.argv[1:]; from m3compile.cli import main; main()" "$@"
X
chmod +x /tmp/m3c_rows
for S in "32 8 g4"; do set -- $S
  for rows in 2048 4096; do
    TO=100 t /tmp/m3c_rows $rows bench --heads $1 --kv-heads $2 --prefill-lengths 128K --decode-lengths '' --selection independent --no-flex --out $O/b_$3_$rows > $O/bench_$3_$rows.log 2>&1
    cp $O/b_$3_$rows/bench.json $O/bench_$3_$rows.json
  done
done
for rows in 2048 4096; do
  TO=120 t /tmp/m3c_rows $rows bench --distill smollm2-135m --distill-seq-len 8K --distill-batch 2 --block 128 --topk 16 --steps 3 --cuda-graph --no-train --no-eval --out $O/d_$rows > $O/distill_$rows.log 2>&1
  cp $O/d_$rows/distill.json $O/distill_$rows.json 2>/dev/null
done
python - <<'PY' >&2
import json, glob
for n in ("g4",):
    for rows in (2048, 4096):
        try:
            d = json.load(open(f'/tmp/r/bench_{n}_{rows}.json')); r = d['prefill'][0]; s = d['speedups']['prefill'][0]
            print(n, rows, 'attention_ms', round(r['attention_ms'], 3), 'dense', round(r['dense_ms'], 2), 'share', round(s['share_of_ideal'], 4))
        except Exception as e: print(n, rows, 'ERR', e)
PY
for rows in 2048 4096; do echo "== distill $rows" >&2; grep -i -E "distill (warm|sparse)|ratio|tokens/s" $O/distill_$rows.log | head -12 >&2; done
tar -czf $OUT/s16d.tgz -C $O --exclude='b_*' --exclude='d_*' .
