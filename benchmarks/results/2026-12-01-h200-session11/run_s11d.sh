#!/usr/bin/env bash
# session 11, call D: SmolLM2 at 8K with index dim 128 (twice its head dim; M3's) and the block loss lambda 3, at
# block 64 / top-8 and at M3's block 128 / top-16, 900 steps each, side by side (tokens/s not figures); the inits'
# evals (128 / 16 with the oracle row) and the distilled models' evals and retrieval.
R=$PWD; O=/tmp/r; L=/tmp/log; rm -rf $O $L; mkdir -p $O $L
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -rL $R/m3compile /tmp/pkg/ && rm -rf /tmp/pkg/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg/m3compile/$d; done
cat /tmp/m/part_aa $R/.carry/b/part_ab > /tmp/m/model.gguf && ls -l /tmp/m >&2
python -m pip install -q --no-index --no-deps $R/.carry/b/gguf-*.whl 2>&1 | tail -1
python $R/.carry/b/smollm2.py /tmp/m/hf --gguf /tmp/m/model.gguf 2>&1 | tail -1
mkdir -p /tmp/data && cp $R/.carry/b/*.npy /tmp/data/
export PYTHONPATH=/tmp/pkg M3C_AUTOTUNE=0 OMP_NUM_THREADS=4; cd /tmp
M="python -m m3compile.cli"; C=/tmp/data/calib_code_smollm2.npy; E=/tmp/data/eval_code_smollm2.npy
t() { local s=$SECONDS; echo "+ ${*:1:12}" >&2; timeout ${TO:-200} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
CV="--dense-layers 0 --index-dim 128 --calib $C --calib-tokens 8192 --calib-device cuda --force --json"
D="--data $C --seq-len 8192 --batch 2 --lr 3e-3 --warmup-steps 20 --checkpoint-every 100000 --device cuda --json --steps 900 --force --block-loss 3"
TO=60 t $M convert /tmp/m/hf /tmp/q/w64 --block-size 64 --topk 8 $CV > $O/w64.convert.json
TO=60 t $M convert /tmp/m/hf /tmp/q/w128 --block-size 128 --topk 16 $CV > $O/w128.convert.json
TO=245 t $M distill /tmp/q/w64 --out /tmp/q/w64d $D > $O/w64d.distill.json 2> $L/w64d.err &
TO=245 t $M distill /tmp/q/w128 --out /tmp/q/w128d $D > $O/w128d.distill.json 2> $L/w128d.err &
TO=120 t $M eval /tmp/q/w128 --data $E --seq-len 8192 --device cuda --json > $O/w128.eval.json
TO=90 t $M eval /tmp/q/w64 --data $E --seq-len 8192 --device cuda --no-oracle --json > $O/w64.eval.json
wait
for x in w64d w128d; do TO=60 t $M eval /tmp/q/$x --data $E --seq-len 8192 --device cuda --no-oracle --json > $O/$x.eval.json & done; wait
for x in w64d; do TO=60 t $M eval /tmp/q/$x --data $E --task retrieval --seq-len 8192 --device cuda --json > $O/$x.retrieval.json & done; wait
python $R/.carry/merge.py $O $OUT/s11d.json
for f in $L/*; do echo "== $f"; tail -n 5 $f; done > $OUT/logs.txt
