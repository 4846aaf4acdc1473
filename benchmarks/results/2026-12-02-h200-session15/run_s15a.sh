#!/usr/bin/env bash
# session 15, call A: the gather kernel's scalar first-token test (NEW) against the tile-wide min (OLD) at G = 4, 7,
# 16; the combine at 1-8 warps; the gather kernel's stall reasons (ncu)
R=$PWD; . $R/.carry/setup.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader >&2
for S in "32 8 g4" "28 4 g7" "64 4 g16"; do set -- $S
  for P in new old; do
    PP=$NEW; [ $P = old ] && PP=$OLD
    PYTHONPATH=$PP timeout 90 python $X/sparse_attention_profile.py --lengths 131072 --heads $1 --kv-heads $2 --tiles none > $O/prof_${3}_$P.json 2>$O/err_${3}_$P.txt
  done
done
for S in "32 8 g4" "28 4 g7" "64 4 g16"; do set -- $S
  timeout 90 python $X/combine_config.py --heads $1 --kv-heads $2 > $O/combine_$3.log 2>&1
done
timeout 150 /usr/local/cuda/bin/ncu --clock-control none -k regex:gather_q_fwd_kernel --launch-skip 2 --launch-count 1 \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
  python $X/sparse_attention_profile.py --lengths 65536 --tiles none > $O/ncu_stalls.txt 2>&1
python - <<'PY' >&2
import json, glob
for f in sorted(glob.glob('/tmp/r/prof_*.json')):
    try:
        r = json.load(open(f))['rows'][0]
        print(f.split('/')[-1], r['ms'], r['gather_stage_ms'], r['share_of_ideal'], [k[:2] for k in r['kernels'][:2]])
    except Exception as e:
        print(f, 'ERR', e, open(f.replace('prof_', 'err_').replace('.json', '.txt')).read()[-500:])
for f in sorted(glob.glob('/tmp/r/combine_*.log')):
    print(f.split('/')[-1], [l.strip() for l in open(f) if l.startswith('{')])
PY
grep -E "stalled|inst_executed|tensor" $O/ncu_stalls.txt | sed 's/  */ /g' >&2
tar -czf $OUT/s15a.tgz -C $O .
