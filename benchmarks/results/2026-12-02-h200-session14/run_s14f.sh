#!/usr/bin/env bash
# session 14, call F: the new gather-Q forward autotuned over its whole config space (TMA box per config)
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
export PYTHONPATH=/tmp/pkg_new M3C_AUTOTUNE=1 M3C_AUTOTUNE_CACHE=0 TRITON_PRINT_AUTOTUNING=1; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
X=$R/benchmarks/experiments
TO=200 t python $X/sparse_attention_profile.py --lengths 131072 --tiles none > $O/tune_g4.log 2>&1
TO=200 t python $X/sparse_attention_profile.py --lengths 131072 --heads 64 --kv-heads 4 --tiles none > $O/tune_m3.log 2>&1
cp $O/*.log $OUT/
grep -h "best config\|finished" $O/*.log | head -20 >&2; grep -h '"share_of_ideal"' $O/*.log | cut -c1-300 >&2
