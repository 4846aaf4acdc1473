#!/usr/bin/env bash
# session 17, call B: 4,096 gathered rows per program for query chunks of at least LONG_ROWS rows (the new policy)
# against 2,048 everywhere (LONG_ROWS set past any chunk), in one call: `m3c bench` at G = 4 (32K, 128K), Qwen's
# G = 7 and M3's G = 16 (128K); the whole Llama-3-8B-shaped model at 128K with the policy; the interpreter-untestable
# part at full size: check_kernels --only sparse with the policy
R=$PWD; . $R/benchmarks/results/2026-12-02-h200-session16/setup.sh
cat > /tmp/m3c_long <<'X'
#!/usr/bin/env bash
long=$1; shift
exec python -c "import sys; import m3compile.kernels.sparse_attention as sa; sa.LONG_ROWS = $long; sys.argv = ['m3c'] + sys.argv[1:]; from m3compile.cli import main; main()" "$@"
X
chmod +x /tmp/m3c_long
for S in "32 8 g4 32K,128K" "28 4 g7 128K" "64 4 m3 128K"; do set -- $S
  for mode in policy r2048; do
    long=$([ $mode = policy ] && echo "1 << 24" || echo "1 << 62")
    TO=150 t /tmp/m3c_long "$long" bench --heads $1 --kv-heads $2 --prefill-lengths $4 --decode-lengths '' --selection independent --no-flex --out $O/b_$3_$mode > $O/bench_$3_$mode.log 2>&1
    cp $O/b_$3_$mode/bench.json $O/bench_$3_$mode.json
  done
done
python - <<'PY' >&2
import json
for n in ('g4', 'g7', 'm3'):
    for mode in ('policy', 'r2048'):
        try:
            d = json.load(open(f'/tmp/r/bench_{n}_{mode}.json'))
            for r, s in zip(d['prefill'], d['speedups']['prefill']):
                print(n, mode, r['T'], 'attention_ms', round(r['attention_ms'], 3), 'dense', round(r['dense_ms'], 2), 'share', round(s['share_of_ideal'], 4), 'msa_x', round(s['msa_x'], 3))
        except Exception as e: print(n, mode, 'ERR', repr(e)[:200])
PY
TO=150 t python $R/benchmarks/check_kernels.py --only sparse --json $O/check_sparse.json > $O/check_sparse.log 2>&1
grep -c PASS $O/check_sparse.log >&2; grep -v PASS $O/check_sparse.log | tail -5 >&2
cat > /tmp/same.py <<'PY'
# the policy's 4,096-row programs against 2,048-row ones at 128K, G = 4, on the bench's inputs: the same output
import torch
from m3compile.kernels import sparse_attention as sa
from m3compile.kernels.indexer import select_blocks
from m3compile.tools import bench
cfg = bench.BenchConfig(heads=32, kv_heads=8, prefill_lengths=(131072,), decode_lengths=(), selections=("independent",), flex=False, device="cuda")
q, k, v, qi, ki = bench.prefill_inputs(cfg, 131072)
blocks = select_blocks(qi, ki, block_size=128, topk=16)
a = sa.sparse_attention(q, k, v, blocks, block_size=128)
sa.LONG_ROWS = 1 << 62
b = sa.sparse_attention(q, k, v, blocks, block_size=128)
print("policy vs 2048 rows at 128K, G = 4: max abs diff", (a.float() - b.float()).abs().max().item(), "bitwise", torch.equal(a, b))
PY
TO=60 t python /tmp/same.py >&2
TO=200 t python -m m3compile.cli bench --model llama3-8b --prefill-lengths 128K --decode-lengths '' --steps 3 --index-dim 64 --index-dtype fp8 --index-cache fp8 --out $O/model > $O/model.log 2>&1
for f in $O/model/*; do cp $f $O/model_$(basename $f); done
grep -h "131,072" $O/model.log | head >&2
tar -czf $OUT/s17b.tgz -C $O --exclude='b_*' --exclude=model .
