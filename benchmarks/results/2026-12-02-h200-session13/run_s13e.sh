#!/usr/bin/env bash
# session 13, call E: the README's whole-model plot with the final kernels, both presets into one OUT
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
export M3C_AUTOTUNE=0 PYTHONPATH=/tmp/pkg_new; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
for m in llama3-8b qwen2.5-7b; do
  TO=125 t python -m m3compile.cli bench --model $m --prefill-lengths 32K,128K,512K --decode-lengths 32K,128K --batch 8 --steps 2 --index-dim 64 --index-dtype fp8 --index-cache fp8 --out $O/plot > $O/$m.log 2>&1
done
cp $O/plot/* $O/*.log $OUT/; ls -la $O/plot >&2
