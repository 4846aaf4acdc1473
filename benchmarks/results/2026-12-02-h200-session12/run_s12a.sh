#!/usr/bin/env bash
# session 12, call A: (1) the kernels cold and right after a matmul load, and the whole Llama-3-8B-shaped model at
# 128K with nvidia-smi logging its clocks (alone on the GPU); (2) dense-llama-byte with the wider head (index dim 128,
# the 0.01 init) at block 64 / top-8 and 128 / top-16, distilled 900 steps (two side by side: tokens/s not figures);
# (3) beside them, why some distillations killed by a signal died without saving: SigCgt and exit codes.
R=$PWD; O=/tmp/r; L=/tmp/log; rm -rf $O $L; mkdir -p $O $L
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -rL $R/m3compile /tmp/pkg/ && rm -rf /tmp/pkg/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg/m3compile/$d; done
mkdir -p /tmp/data && cp $R/.carry/a/shared/data/*.bin /tmp/data/
export PYTHONPATH=/tmp/pkg M3C_AUTOTUNE=0; cd /tmp
M="python -m m3compile.cli"; B=/tmp/data/eval_code.bin; C=/tmp/data/calib_code.bin; BY=$R/.carry/a/shared/checkpoints/dense-llama-byte
t() { local s=$SECONDS; echo "+ ${*:1:12}" >&2; timeout ${TO:-200} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 100 > $L/smi.csv 2>&1 &
SMI=$!
TO=120 t python $R/benchmarks/experiments/kernels_under_load.py --length 131072 --reps 7 > $L/load.txt
tail -1 $L/load.txt > $O/load.json
date +%s.%N > $L/bm_start
TO=200 t $M bench --model llama3-8b --prefill-lengths 128K --decode-lengths '' --steps 2 --index-dim 64 --index-dtype fp8 --out /tmp/bm > $L/bm.txt 2>&1
date +%s.%N > $L/bm_end
kill $SMI
cp /tmp/bm/*.json $O/bm.json
python - $L > $O/clocks.json <<'PY'
import csv, json, sys, statistics, datetime
L = sys.argv[1]
rows = list(csv.reader(open(f"{L}/smi.csv")))[1:]
t0, t1 = float(open(f"{L}/bm_start").read()), float(open(f"{L}/bm_end").read())
pts = []
for r in rows:
    try:
        ts = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc).timestamp()
        pts.append((ts, float(r[1].split()[0]), float(r[3].split()[0]), r[5].strip()))
    except Exception:
        pass
def summ(p):
    if not p: return {}
    sm = sorted(x[1] for x in p); pw = sorted(x[2] for x in p)
    q = lambda a, f: a[min(len(a) - 1, int(f * len(a)))]
    return {"n": len(p), "sm_p10": q(sm, .1), "sm_p50": q(sm, .5), "sm_p90": q(sm, .9), "power_p50": q(pw, .5), "power_p90": q(pw, .9),
            "throttle": sorted(set(x[3] for x in p))[:6]}
busy = [p for p in pts if p[2] > 200]
print(json.dumps({"all": summ(pts), "busy_over_200W": summ(busy), "bench_window_samples": sum(t0 <= p[0] <= t1 for p in pts),
                  "series": [(round(p[0] - pts[0][0], 1), p[1], p[2]) for p in pts[::10]]}))
PY
# (2) + (3)
export OMP_NUM_THREADS=4
CV="--dense-layers 0 --index-dim 128 --calib $C --calib-tokens 8192 --calib-device cuda --force --json"
D="--data $C --seq-len 8192 --batch 2 --lr 1e-3 --warmup-steps 20 --checkpoint-every 100000 --device cuda --json --steps 900 --force --block-loss 1"
TO=60 t $M convert $BY /tmp/q/w64 --block-size 64 --topk 8 $CV > $O/w64.convert.json
TO=60 t $M convert $BY /tmp/q/w128 --block-size 128 --topk 16 $CV > $O/w128.convert.json
TO=240 t $M distill /tmp/q/w64 --out /tmp/q/w64d $D > $O/w64d.distill.json 2> $L/w64d.err &
TO=240 t $M distill /tmp/q/w128 --out /tmp/q/w128d $D > $O/w128d.distill.json 2> $L/w128d.err &
TO=150 t $M eval /tmp/q/w128 --data $B --seq-len 8192 --device cuda --json > $O/w128.eval.json &
TO=100 t $M eval /tmp/q/w64 --data $B --seq-len 8192 --device cuda --no-oracle --json > $O/w64.eval.json &
DS="--data $C --seq-len 8192 --batch 2 --steps 5000 --checkpoint-every 100000 --device cuda --json --force"
for i in 1 2; do $M distill /tmp/q/w64 --out /tmp/q/sig$i $DS > $L/sig$i.out 2> $L/sig$i.err & eval "P$i=\$!"; done
timeout 50 $M distill /tmp/q/w64 --out /tmp/q/sig3 $DS > $L/sig3.out 2> $L/sig3.err &
P3=$!
sleep 50
{ for i in 1 2; do eval "p=\$P$i"; echo "sig$i pid $p: $(grep -E 'SigCgt|SigIgn' /proc/$p/status | tr '\n' ' ')"
    for tk in /proc/$p/task/*; do echo "  task $(basename $tk) $(cat $tk/comm) $(grep SigBlk $tk/status)"; done | head -12; done
  kill -TERM $P1; kill -TERM $P2; kill -TERM $P2
  wait $P1; echo "sig1 (one TERM) rc $?"; wait $P2; echo "sig2 (two TERMs back to back) rc $?"; wait $P3; echo "sig3 (timeout 50) rc $?"
  for i in 1 2 3; do echo "== sig$i err:"; tail -c 600 $L/sig$i.err; ls /tmp/q/sig$i 2>&1 | head -5; done; } > $O/sigterm.txt 2>&1
wait
for x in w64d w128d; do TO=100 t $M eval /tmp/q/$x --data $B --seq-len 8192 --device cuda --no-oracle --json > $O/$x.eval.json & done
wait
cp $O/sigterm.txt $OUT/sigterm.txt
python $R/.carry/merge.py $O $OUT/s12a.json
for f in $L/*.txt $L/*.err; do echo "== $f"; tail -n 8 $f; done > $OUT/logs.txt
