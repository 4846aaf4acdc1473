#!/usr/bin/env bash
# session 12, call B: stage part_aa for call C; dense-llama-byte with index rope "tile" (index dim 96 = twice its
# head dim: two shared-key ranks per pair, exact for its 2 KV heads; and 128) at block 64 / top-8, 900 steps each,
# side by side (tokens/s not figures); beside them a distillation under `timeout` with the step-end stop.
R=$PWD; O=/tmp/r; L=/tmp/log; rm -rf $O $L; mkdir -p $O $L /tmp/m
cp .carry/a/part_aa /tmp/m/ &
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -rL $R/m3compile /tmp/pkg/ && rm -rf /tmp/pkg/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg/m3compile/$d; done
mkdir -p /tmp/data && cp $R/.carry/a/shared/data/*.bin /tmp/data/
export PYTHONPATH=/tmp/pkg M3C_AUTOTUNE=0 OMP_NUM_THREADS=4; cd /tmp
M="python -m m3compile.cli"; B=/tmp/data/eval_code.bin; C=/tmp/data/calib_code.bin; BY=$R/.carry/a/shared/checkpoints/dense-llama-byte
t() { local s=$SECONDS; echo "+ ${*:1:12}" >&2; timeout ${TO:-200} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
CV="--block-size 64 --topk 8 --dense-layers 0 --calib $C --calib-tokens 8192 --calib-device cuda --force --json"
D="--data $C --seq-len 8192 --batch 2 --lr 1e-3 --warmup-steps 20 --checkpoint-every 100000 --device cuda --json --steps 900 --force --block-loss 1"
TO=60 t $M convert $BY /tmp/q/t96 --index-dim 96 $CV > $O/t96.convert.json
TO=60 t $M convert $BY /tmp/q/t128 --index-dim 128 $CV > $O/t128.convert.json
TO=240 t $M distill /tmp/q/t96 --out /tmp/q/t96d $D > $O/t96d.distill.json 2> $L/t96d.err &
TO=240 t $M distill /tmp/q/t128 --out /tmp/q/t128d $D > $O/t128d.distill.json 2> $L/t128d.err &
TO=100 t $M eval /tmp/q/t96 --data $B --seq-len 8192 --device cuda --no-oracle --json > $O/t96.eval.json &
TO=100 t $M eval /tmp/q/t128 --data $B --seq-len 8192 --device cuda --no-oracle --json > $O/t128.eval.json &
DS="--data $C --seq-len 8192 --batch 2 --steps 5000 --checkpoint-every 100000 --device cuda --json --force"
PYTHONFAULTHANDLER=1 timeout --preserve-status 50 $M distill /tmp/q/t96 --out /tmp/q/sig3 $DS > $L/sig3.out 2> $L/sig3.err &
P3=$!
sleep 25; C3=$(pgrep -P $P3 | head -1)
{ echo "sig3 child $C3: $(grep -E 'SigCgt|SigIgn' /proc/$C3/status | tr '\n' ' ')"; ps -o pid,pgid,comm --ppid $C3
  wait $P3; echo "sig3 (timeout --preserve-status 50) rc $?"; echo "== sig3 err:"; tail -c 1500 $L/sig3.err; ls /tmp/q/sig3 2>&1 | head -5; } > $O/sigterm.txt 2>&1
wait
for x in t96d t128d; do TO=100 t $M eval /tmp/q/$x --data $B --seq-len 8192 --device cuda --no-oracle --json > $O/$x.eval.json & done
wait; ls -la /tmp/m >&2
cp $O/sigterm.txt $OUT/sigterm.txt
python $R/.carry/merge.py $O $OUT/s12b.json
for f in $L/*.err; do echo "== $f"; tail -n 5 $f; done > $OUT/logs.txt
