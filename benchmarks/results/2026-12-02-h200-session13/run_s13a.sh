#!/usr/bin/env bash
# session 13, call A: old (18a2836) against new kernels: gather-Q's unmasked path, fp8 index keys with one scale per
# key block; full-size checks; the whole Llama-3-8B-shaped model and M3 shapes with the new kernels.
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new /tmp/pkg_old && mkdir -p /tmp/pkg_new /tmp/pkg_old
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
cp -rL $R/.carry/old/m3compile /tmp/pkg_old/ && rm -rf /tmp/pkg_old/m3compile/{kernels,models,passes}
for d in kernels models passes; do cp -r $R/.carry/old/$d /tmp/pkg_old/m3compile/$d; done
export M3C_AUTOTUNE=0; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
X=$R/benchmarks/experiments
for P in old new; do
  export PYTHONPATH=/tmp/pkg_$P
  for D in 64 128; do t python $X/indexer_key_scale.py --length 131072 --dim $D > $O/idx${D}_$P.json; done
  t python $X/sparse_attention_profile.py --lengths 131072 --tiles 16 > $O/sparse_g4_$P.json
  t python $X/sparse_attention_profile.py --lengths 131072 --heads 64 --kv-heads 4 --tiles 4 > $O/sparse_m3_$P.json
done
export PYTHONPATH=/tmp/pkg_new
TO=150 t python $R/benchmarks/check_kernels.py --only indexer --json $O/check_indexer.json > $O/check_indexer.log 2>&1
TO=150 t python $R/benchmarks/check_kernels.py --only sparse --json $O/check_sparse.json > $O/check_sparse.log 2>&1
M="python -m m3compile.cli"
TO=100 t $M bench --heads 64 --kv-heads 4 --prefill-lengths 128K --decode-lengths '' --selection independent --no-flex --out $O/m3_shapes.json > $O/m3_shapes.log 2>&1
TO=240 t $M bench --model llama3-8b --prefill-lengths 128K --decode-lengths '' --steps 2 --index-dim 64 --index-dtype fp8 --out $O/model128k.json > $O/model128k.log 2>&1
python $R/.carry/merge.py $O $OUT/s13a.json
cp $O/*.log $OUT/ 2>/dev/null; ls -la $O >&2
