#!/usr/bin/env bash
# session 13, call B: the int16 CSR sort + gather-Q fast path + per-block fp8 key scales, all on: sparse profiles,
# autotune check of gather-Q, full-size checks (sparse, fused CSR, decode, generate), whole model prefill 128K/512K
# and decode 32K/128K with the fp8 index cache, M3 shapes.
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
export M3C_AUTOTUNE=0 PYTHONPATH=/tmp/pkg_new; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
X=$R/benchmarks/experiments; M="python -m m3compile.cli"
t python $X/sparse_attention_profile.py --lengths 131072 --tiles 16 > $O/sparse_g4.json
t python $X/sparse_attention_profile.py --lengths 131072 --heads 64 --kv-heads 4 --tiles 4 > $O/sparse_m3.json
TO=150 t $M bench --model llama3-8b --prefill-lengths 128K,512K --decode-lengths 32K,128K --batch 8 --steps 2 --index-dim 64 --index-dtype fp8 --index-cache fp8 --out $O/model > $O/model.log 2>&1
TO=60 t $M bench --heads 64 --kv-heads 4 --prefill-lengths 128K --decode-lengths '' --selection independent --no-flex --out $O/m3 > $O/m3.log 2>&1
TO=150 t python $R/benchmarks/check_kernels.py --only sparse --json $O/check_sparse.json > $O/check.log 2>&1
TO=100 t python $R/benchmarks/check_kernels.py --only fused --json $O/check_fused.json >> $O/check.log 2>&1
TO=100 t python $R/benchmarks/check_kernels.py --only decode --json $O/check_decode.json >> $O/check.log 2>&1
TO=100 t python $R/benchmarks/check_kernels.py --only generate --json $O/check_generate.json >> $O/check.log 2>&1
M3C_AUTOTUNE=1 M3C_AUTOTUNE_CACHE=0 TRITON_PRINT_AUTOTUNING=1 TO=150 t python $X/sparse_attention_profile.py --lengths 131072 --tiles 16 > $O/sparse_g4_autotune.json 2> $O/autotune.log
for d in model m3; do for f in $O/$d/*.json; do cp $f $O/${d}_$(basename $f); done; done
python $R/.carry/merge.py $O $OUT/s13b.json
cp $O/*.log $O/model/*.png $OUT/ 2>/dev/null; ls -la $O >&2
