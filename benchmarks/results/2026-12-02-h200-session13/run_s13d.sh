#!/usr/bin/env bash
# session 13, call D: the final kernels (gather-Q 2048 rows per program): the whole model at 128K twice, M3 shapes,
# and the distillation step with 2048 against 1024 rows per program (the fused KL walks the forward's CSR).
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
export M3C_AUTOTUNE=0 PYTHONPATH=/tmp/pkg_new; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
M="python -m m3compile.cli"
for run in 1 2; do
  TO=150 t $M bench --model llama3-8b --prefill-lengths 128K --decode-lengths '' --steps 2 --index-dim 64 --index-dtype fp8 --out $O/model$run > $O/model$run.log 2>&1
done
TO=60 t $M bench --heads 64 --kv-heads 4 --prefill-lengths 128K --decode-lengths '' --selection independent --no-flex --out $O/m3 > $O/m3.log 2>&1
W="import sys, m3compile.kernels.sparse_attention as sa; sa.FORWARD_CHUNK_ROWS = int(sys.argv.pop(1)); from m3compile.cli import main; main()"
for C in 2048 1024; do
  TO=120 t python -c "$W" $C bench --distill smollm2-135m --distill-seq-len 8K --distill-batch 2 --block 128 --topk 16 --steps 5 --cuda-graph --out $O/distill_c$C > $O/distill_c$C.log 2>&1
done
for d in model1 model2 m3 distill_c2048 distill_c1024; do for f in $O/$d/*.json; do cp $f $O/${d}_$(basename $f); done; done
python $R/.carry/merge.py $O $OUT/s13d.json
cp $O/*.log $OUT/ 2>/dev/null; ls -la $O >&2
