#!/usr/bin/env bash
# session 14, call B: gather-Q store variants (head-dim split, entry-order layout, TMA store)
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
export M3C_AUTOTUNE=0 PYTHONPATH=/tmp/pkg_new; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
X=$R/benchmarks/experiments
TO=300 t python $X/gather_variants.py --configs 64x4x2,64x4x2x168 --variants base,rowsum,dsplit,entry,entry_dsplit,entry_tma,noprefetch > $O/variants_b.json 2> $O/variants_b.err
tail -c 3000 $O/variants_b.err >&2
cp $O/* $OUT/
