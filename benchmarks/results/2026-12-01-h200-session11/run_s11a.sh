#!/usr/bin/env bash
# session 11, call A: stage part_aa for call B; the indexer without the full-block mask against the old kernel
# (same run); the query-tile sparse kernel against gather-Q (Llama-3-8B and M3 shapes); the whole Llama-3-8B-shaped
# model at 128K with either sparse kernel.
R=$PWD; O=/tmp/r; L=/tmp/log; rm -rf $O $L; mkdir -p $O $L /tmp/m
cp .carry/a/part_aa /tmp/m/ &
mk() { rm -rf $1 && mkdir -p $1 && cp -rL $R/m3compile $1/ && rm -rf $1/m3compile/{kernels,models,passes}
       for d in models passes; do ln -sfn $R/$d $1/m3compile/$d; done; cp -r $R/kernels $1/m3compile/kernels; }
mk /tmp/pkg; mk /tmp/pkg_old; cp $R/.carry/c/_tl_indexer_old.py /tmp/pkg_old/m3compile/kernels/_tl_indexer.py
export M3C_AUTOTUNE=0; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:12}" >&2; timeout ${TO:-200} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
for d in 64 128; do for p in old new; do P=/tmp/pkg; [ $p = old ] && P=/tmp/pkg_old
  PYTHONPATH=$P TO=60 t python $R/benchmarks/experiments/indexer_split.py --lengths 131072 --dim $d --modes topk --sweep none --reps 7 > $L/split_d${d}_$p.txt
  tail -1 $L/split_d${d}_$p.txt > $O/split_d${d}_$p.json
done; done
export PYTHONPATH=/tmp/pkg
TO=120 t python $R/benchmarks/experiments/sparse_attention_profile.py --lengths 131072 --tiles 8,16,32 > $L/sa_llama.txt
tail -1 $L/sa_llama.txt > $O/sa_llama.json
TO=120 t python $R/benchmarks/experiments/sparse_attention_profile.py --lengths 131072 --heads 64 --kv-heads 4 --tiles 2,4,8 > $L/sa_m3.txt
tail -1 $L/sa_m3.txt > $O/sa_m3.json
for k in gather tile; do
  TO=150 t python -m m3compile.cli bench --model llama3-8b --prefill-lengths 128K --decode-lengths '' --steps 3 --index-dim 64 --index-dtype fp8 --sparse-kernel $k --out /tmp/bm_$k > $L/bm_$k.txt 2>&1
  for f in /tmp/bm_$k/*.json; do cp $f $O/bm_${k}_$(basename $f); done
done
TO=150 t python -m m3compile.cli bench --distill smollm2-135m --distill-seq-len 8K --distill-batch 2 --block 64 --topk 8 --steps 3 --no-train --out /tmp/bd > $L/bench_distill.txt 2>&1
for f in /tmp/bd/*.json; do cp $f $O/bench_distill_$(basename $f); done
wait; ls -la /tmp/m >&2
python $R/.carry/merge.py $O $OUT/s11a.json
for f in $L/*.txt; do echo "== $f"; tail -n 25 $f; done > $OUT/logs.txt
