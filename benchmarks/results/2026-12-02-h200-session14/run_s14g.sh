#!/usr/bin/env bash
# session 14, call G: TMA against masked stores of the entry-order partials, at G = 7 (GP = 8: TMA also writes the
# padding head rows) and G = 4
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
export M3C_AUTOTUNE=0 PYTHONPATH=/tmp/pkg_new; cd /tmp
X=$R/benchmarks/experiments
W="import sys, runpy, m3compile.kernels.sparse_attention as sa; sa._tma_store = lambda *a: False; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
for S in "28 4 g7" "32 8 g4"; do set -- $S
  timeout 60 python $X/sparse_attention_profile.py --lengths 131072 --heads $1 --kv-heads $2 --tiles none > $O/tma_$3.json 2>/dev/null
  timeout 60 python -c "$W" $X/sparse_attention_profile.py --lengths 131072 --heads $1 --kv-heads $2 --tiles none > $O/masked_$3.json 2>/dev/null
done
cp $O/* $OUT/; for f in $O/*.json; do echo $f; python -c "import json,sys; r=json.load(open('$f'))['rows'][0]; print(r['ms'], r['gather_stage_ms'], r['share_of_ideal'], r['kernels'][:2])"; done >&2
