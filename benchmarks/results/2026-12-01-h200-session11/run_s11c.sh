#!/usr/bin/env bash
# session 11, call C: stage part_aa for call D; dense-llama-byte at block 64 / top-8, 900 steps each, side by side
# (tokens/s not figures): index dim 128 (M3's) with lambda 1 and 3, and the head dim (48) with lambda 3.
R=$PWD; O=/tmp/r; L=/tmp/log; rm -rf $O $L; mkdir -p $O $L /tmp/m
cp .carry/a/part_aa /tmp/m/ &
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -rL $R/m3compile /tmp/pkg/ && rm -rf /tmp/pkg/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg/m3compile/$d; done
mkdir -p /tmp/data && cp $R/.carry/a/shared/data/*.bin /tmp/data/
export PYTHONPATH=/tmp/pkg M3C_AUTOTUNE=0 OMP_NUM_THREADS=4; cd /tmp
M="python -m m3compile.cli"; B=/tmp/data/eval_code.bin; C=/tmp/data/calib_code.bin; BY=$R/.carry/a/shared/checkpoints/dense-llama-byte
t() { local s=$SECONDS; echo "+ ${*:1:12}" >&2; timeout ${TO:-200} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
CV="--block-size 64 --topk 8 --dense-layers 0 --calib $C --calib-tokens 8192 --calib-device cuda --force --json"
D="--data $C --seq-len 8192 --batch 2 --lr 1e-3 --warmup-steps 20 --checkpoint-every 100000 --device cuda --json --steps 900 --force"
TO=60 t $M convert $BY /tmp/q/b48 $CV > $O/b48.convert.json
TO=60 t $M convert $BY /tmp/q/b128 --index-dim 128 $CV > $O/b128.convert.json
TO=150 t $M distill /tmp/q/b128 --out /tmp/q/b128l1 --block-loss 1 $D > $O/b128l1.distill.json 2> $L/b128l1.err &
TO=150 t $M distill /tmp/q/b128 --out /tmp/q/b128l3 --block-loss 3 $D > $O/b128l3.distill.json 2> $L/b128l3.err &
TO=150 t $M distill /tmp/q/b48 --out /tmp/q/b48l3 --block-loss 3 $D > $O/b48l3.distill.json 2> $L/b48l3.err &
TO=100 t $M eval /tmp/q/b128 --data $B --seq-len 8192 --device cuda --no-oracle --json > $O/b128.eval.json
wait
for x in b128l1 b128l3 b48l3; do TO=100 t $M eval /tmp/q/$x --data $B --seq-len 8192 --device cuda --no-oracle --json > $O/$x.eval.json & done
wait; ls -la /tmp/m >&2
python $R/.carry/merge.py $O $OUT/s11c.json
for f in $L/*; do echo "== $f"; tail -n 5 $f; done > $OUT/logs.txt
