#!/usr/bin/env bash
# session 13, call C: gather-Q rows per program (FORWARD_CHUNK_ROWS) swept at G = 4 and 16; the indexer's tile config
# re-tuned with per-block key scales; the whole model at 128K with the default and the best chunk.
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
export M3C_AUTOTUNE=0 PYTHONPATH=/tmp/pkg_new; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
X=$R/benchmarks/experiments
t python $X/sparse_attention_profile.py --lengths 131072 --tiles none --chunk-rows 512,1024,2048,4096 > $O/chunk_g4.json
t python $X/sparse_attention_profile.py --lengths 131072 --heads 64 --kv-heads 4 --tiles none --chunk-rows 512,1024,2048,4096 > $O/chunk_m3.json
BEST=$(python -c "import json,sys; r=json.load(open('$O/chunk_g4.json'))['rows'][0]['chunk_rows_ms']; print(min(r, key=r.get))")
echo "best chunk rows at G=4: $BEST" >&2
M3C_AUTOTUNE=1 M3C_AUTOTUNE_CACHE=0 TRITON_PRINT_AUTOTUNING=1 t python $X/indexer_key_scale.py --length 131072 --dim 64 > $O/idx_autotune.log 2>&1
W="import sys, m3compile.kernels.sparse_attention as sa; sa.FORWARD_CHUNK_ROWS = int(sys.argv.pop(1)); from m3compile.cli import main; main()"
for C in 1024 $BEST; do
  [ "$C" != "$DONE" ] || continue
  TO=150 t python -c "$W" $C bench --model llama3-8b --prefill-lengths 128K --decode-lengths '' --steps 2 --index-dim 64 --index-dtype fp8 --out $O/model_c$C > $O/model_c$C.log 2>&1
  DONE=$C
  for f in $O/model_c$C/*.json; do cp $f $O/model_c${C}_$(basename $f); done
done
python $R/.carry/merge.py $O $OUT/s13c.json
cp $O/*.log $OUT/ 2>/dev/null; ls -la $O >&2
