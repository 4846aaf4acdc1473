#!/usr/bin/env bash
# session 11, call B: SmolLM2 at 8K, three distillations side by side on the one GPU (their tokens/s are not
# figures): M3's block 128 / top-16 with the block loss (lambda 1); block 64 / top-8 with lambda 3; block 64 / top-8
# with index dim 128 (twice the head dim: 64 new non-rotated slots). Evals with the oracle rows; retrieval.
R=$PWD; O=/tmp/r; L=/tmp/log; rm -rf $O $L; mkdir -p $O $L
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -rL $R/m3compile /tmp/pkg/ && rm -rf /tmp/pkg/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg/m3compile/$d; done
[ -f /tmp/m/hf/config.json ] || { cat /tmp/m/part_aa $R/.carry/b/part_ab > /tmp/m/model.gguf && ls -l /tmp/m >&2
[ -f /tmp/m/hf/config.json ] || python -m pip install -q --no-index --no-deps $R/.carry/b/gguf-*.whl 2>&1 | tail -1
python $R/.carry/b/smollm2.py /tmp/m/hf --gguf /tmp/m/model.gguf 2>&1 | tail -1; }
mkdir -p /tmp/data && cp $R/.carry/b/*.npy /tmp/data/
export PYTHONPATH=/tmp/pkg M3C_AUTOTUNE=0 OMP_NUM_THREADS=4; cd /tmp
M="python -m m3compile.cli"; C=/tmp/data/calib_code_smollm2.npy; E=/tmp/data/eval_code_smollm2.npy
t() { local s=$SECONDS; echo "+ ${*:1:12}" >&2; timeout ${TO:-200} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
CV="--dense-layers 0 --calib $C --calib-tokens 8192 --calib-device cuda --force --json"
D="--data $C --seq-len 8192 --batch 2 --lr 3e-3 --warmup-steps 20 --checkpoint-every 100000 --device cuda --json --steps 900 --force"
TO=90 t $M convert /tmp/m/hf /tmp/q/c128 --block-size 128 --topk 16 $CV > $O/c128.convert.json
TO=90 t $M convert /tmp/m/hf /tmp/q/c64 --block-size 64 --topk 8 $CV > $O/c64.convert.json
TO=90 t $M convert /tmp/m/hf /tmp/q/cw --block-size 64 --topk 8 --index-dim 128 $CV > $O/cw.convert.json
wait
TO=330 t $M distill /tmp/q/c128 --out /tmp/q/d128 --block-loss 1 $D > $L/d128.txt &
TO=330 t $M distill /tmp/q/c64 --out /tmp/q/d64l3 --block-loss 3 $D > $L/d64l3.txt &
TO=330 t $M distill /tmp/q/cw --out /tmp/q/dw --block-loss 1 $D > $L/dw.txt &
TO=90 t $M eval /tmp/q/c128 --data $E --seq-len 8192 --device cuda --json > $O/c128.eval.json
TO=60 t $M eval /tmp/q/cw --data $E --seq-len 8192 --device cuda --no-oracle --json > $O/cw.eval.json
wait
for x in d128 d64l3 dw; do cp $L/$x.txt $O/$x.distill.json; done
TO=60 t $M eval /tmp/q/d128 --data $E --seq-len 8192 --device cuda --no-oracle --json > $O/d128.eval.json &
TO=60 t $M eval /tmp/q/d64l3 --data $E --seq-len 8192 --device cuda --no-oracle --json > $O/d64l3.eval.json &
TO=60 t $M eval /tmp/q/dw --data $E --seq-len 8192 --device cuda --no-oracle --json > $O/dw.eval.json &
wait
TO=60 t $M eval /tmp/q/d128 --data $E --task retrieval --seq-len 8192 --device cuda --json > $O/d128.retrieval.json &
TO=60 t $M eval /tmp/q/d64l3 --data $E --task retrieval --seq-len 8192 --device cuda --json > $O/d64l3.retrieval.json &
TO=60 t $M eval /tmp/q/dw --data $E --task retrieval --seq-len 8192 --device cuda --json > $O/dw.retrieval.json &
wait
python $R/.carry/merge.py $O $OUT/s11b.json
