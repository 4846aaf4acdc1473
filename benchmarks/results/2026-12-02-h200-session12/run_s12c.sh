#!/usr/bin/env bash
# session 12, call C: SmolLM2 at 8K with index rope "tile" (index dim 128 = twice its head dim: two shared-key ranks
# per pair), block 64 / top-8 and M3's 128 / top-16, 900 steps each side by side (tokens/s not figures); evals
# (128 / 16's init with the oracle row), retrieval.
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
D="--data $C --seq-len 8192 --batch 2 --lr 3e-3 --warmup-steps 20 --checkpoint-every 100000 --device cuda --json --steps 900 --force --block-loss 1"
TO=60 t $M convert /tmp/m/hf /tmp/q/t64 --block-size 64 --topk 8 $CV > $O/t64.convert.json
TO=60 t $M convert /tmp/m/hf /tmp/q/t128 --block-size 128 --topk 16 $CV > $O/t128.convert.json
TO=320 t $M distill /tmp/q/t64 --out /tmp/q/t64d $D > $O/t64d.distill.json 2> $L/t64d.err &
TO=320 t $M distill /tmp/q/t128 --out /tmp/q/t128d $D > $O/t128d.distill.json 2> $L/t128d.err &
TO=150 t $M eval /tmp/q/t128 --data $E --seq-len 8192 --device cuda --json > $O/t128.eval.json &
TO=120 t $M eval /tmp/q/t64 --data $E --seq-len 8192 --device cuda --no-oracle --json > $O/t64.eval.json
wait
for x in t64d t128d; do TO=90 t $M eval /tmp/q/$x --data $E --seq-len 8192 --device cuda --no-oracle --json > $O/$x.eval.json & done; wait
for x in t64d t128d; do TO=90 t $M eval /tmp/q/$x --data $E --task retrieval --seq-len 8192 --device cuda --json > $O/$x.retrieval.json & done; wait
python $R/.carry/merge.py $O $OUT/s12c.json
for f in $L/*; do echo "== $f"; tail -n 5 $f; done > $OUT/logs.txt
