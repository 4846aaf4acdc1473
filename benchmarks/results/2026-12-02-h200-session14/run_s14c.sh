#!/usr/bin/env bash
# session 14, call C: old (7e9a846) against new gather-Q forward (partials in CSR entry order, whole tiles stored by
# TMA, the combine through the inverse permutation); full-size checks; share of ideal at G = 4 / 7 / 16; the whole
# Llama-3-8B-shaped model at 128K
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new /tmp/pkg_old && mkdir -p /tmp/pkg_new /tmp/pkg_old
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
cp -rL $R/.carry/old14/m3compile /tmp/pkg_old/ && rm -rf /tmp/pkg_old/m3compile/{kernels,models,passes}
for d in kernels models passes; do cp -r $R/.carry/old14/$d /tmp/pkg_old/m3compile/$d; done
export M3C_AUTOTUNE=0; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
X=$R/benchmarks/experiments
M="python -m m3compile.cli"
export PYTHONPATH=/tmp/pkg_new
TO=150 t python $R/benchmarks/check_kernels.py --only sparse --json $O/check_sparse.json > $O/check_sparse.log 2>&1
for P in old new; do
  export PYTHONPATH=/tmp/pkg_$P
  t python $X/sparse_attention_profile.py --lengths 131072 --tiles none > $O/sparse_g4_$P.json
  for S in "32 8 g4" "28 4 g7" "64 4 m3"; do set -- $S
    TO=100 t $M bench --heads $1 --kv-heads $2 --prefill-lengths 128K --decode-lengths '' --selection independent --no-flex --out $O/b_$3_$P > $O/bench_$3_$P.log 2>&1
    cp $O/b_$3_$P/bench.json $O/bench_$3_$P.json
  done
done
export PYTHONPATH=/tmp/pkg_new
TO=200 t $M bench --model llama3-8b --prefill-lengths 128K --decode-lengths '' --steps 3 --index-dim 64 --index-dtype fp8 --out $O/model128k > $O/model128k.log 2>&1
for f in $O/model128k/*.json; do cp $f $O/model128k_$(basename $f); done
python $R/.carry/merge.py $O $OUT/s14c.json
tail -n 30 $O/check_sparse.log > $OUT/check_sparse_tail.log; cp $O/model128k.log $OUT/
grep -h "share\|msa ms\|G=\|x " $O/bench_*.log | head -40 >&2
