#!/usr/bin/env bash
# session 17, call A: the counting-sort CSR. Full-size correctness (check_kernels --only sparse: every sparse
# attention case now builds its CSR by counting sort, including session 16's untimed fix for blocks past the token);
# g4_levers at G = 4, 128K (the counting CSR against the radix one, alone and inside the attention, and 4,096 rows
# per program); `m3c bench` at G = 4 with 2,048 and 4,096 rows per program
R=$PWD; . $R/benchmarks/results/2026-12-02-h200-session16/setup.sh
cat > /tmp/m3c_rows <<'X'
#!/usr/bin/env bash
rows=$1; shift
exec python -c "import sys; import m3compile.kernels.sparse_attention as sa; sa.FORWARD_CHUNK_ROWS = $rows; sys.argv = ['m3c'] + sys.argv[1:]; from m3compile.cli import main; main()" "$@"
X
chmod +x /tmp/m3c_rows
TO=150 t python $R/benchmarks/check_kernels.py --only sparse --json $O/check_sparse.json > $O/check_sparse.log 2>&1
tail -15 $O/check_sparse.log >&2
TO=200 t python $X/g4_levers.py --skip graph,one_chunk > $O/levers_g4.json 2> $O/levers_g4.log
grep -h RESULT $O/levers_g4.json | cut -c8- | python -c "
import json,sys; d=json.load(sys.stdin)
for n,r in d['rows'].items(): print(n, r)
print('share', d.get('share_of_ideal')); print('csr_identical', d.get('csr_identical'), 'chunks', d['chunks'])
for k in ('timeline_csr','timeline_csr_radix'): print(k, json.dumps(d[k])[:900])" >&2
tail -3 $O/levers_g4.log >&2
for rows in 2048 4096; do
  TO=100 t /tmp/m3c_rows $rows bench --heads 32 --kv-heads 8 --prefill-lengths 128K --decode-lengths '' --selection independent --no-flex --out $O/b_g4_$rows > $O/bench_g4_$rows.log 2>&1
  cp $O/b_g4_$rows/bench.json $O/bench_g4_$rows.json
done
python - <<'PY' >&2
import json
for rows in (2048, 4096):
    try:
        d = json.load(open(f'/tmp/r/bench_g4_{rows}.json')); r = d['prefill'][0]; s = d['speedups']['prefill'][0]
        print('g4', rows, 'attention_ms', round(r['attention_ms'], 3), 'dense', round(r['dense_ms'], 2), 'share', round(s['share_of_ideal'], 4))
    except Exception as e: print(rows, 'ERR', e)
PY
tar -czf $OUT/s17a.tgz -C $O --exclude='b_*' .
