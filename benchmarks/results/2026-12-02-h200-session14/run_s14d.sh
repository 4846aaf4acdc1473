#!/usr/bin/env bash
# session 14, call D: the whole model with the entry-order gather-Q; decode at the asked batch 8 extrapolated from two
# depths where its caches do not fit (Llama-3-8B at 128K)
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
export M3C_AUTOTUNE=0 PYTHONPATH=/tmp/pkg_new; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
M="python -m m3compile.cli"
TO=320 t $M bench --model llama3-8b --prefill-lengths 32K,128K,512K --decode-lengths 32K,128K --batch 8 --steps 2 --index-dim 64 --index-dtype fp8 --index-cache fp8 --out $O/model > $O/llama.log 2>&1
TO=240 t $M bench --model qwen2.5-7b --prefill-lengths 32K,128K,512K --decode-lengths 32K,128K --batch 8 --steps 2 --index-dim 64 --index-dtype fp8 --index-cache fp8 --out $O/model > $O/qwen.log 2>&1
mkdir -p $OUT/model_plot; cp $O/model/* $OUT/model_plot/; cp $O/*.log $OUT/
tail -n 25 $O/llama.log >&2
