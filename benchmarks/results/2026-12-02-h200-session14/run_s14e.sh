#!/usr/bin/env bash
# session 14, call E: the depth extrapolation checked against a measured decode step at batch 7 (128K); the 128K
# prefill once more
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
export M3C_AUTOTUNE=0 PYTHONPATH=/tmp/pkg_new; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
M="python -m m3compile.cli"
TO=200 t python $R/benchmarks/experiments/decode_depth_check.py --length 131072 --batch 7 --depths 14,29 > $O/depth_check.log 2>&1
grep RESULT $O/depth_check.log > $OUT/depth_check.json
TO=150 t $M bench --model llama3-8b --prefill-lengths 128K --decode-lengths '' --steps 3 --index-dim 64 --index-dtype fp8 --out $O/m2 > $O/prefill2.log 2>&1
cp $O/*.log $OUT/; cp $O/m2/llama3-8b.json $OUT/prefill2_llama3-8b.json
tail -n 3 $O/depth_check.log | cut -c1-400 >&2; grep "131,072 │" $O/prefill2.log >&2
