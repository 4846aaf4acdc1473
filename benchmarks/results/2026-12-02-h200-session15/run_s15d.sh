#!/usr/bin/env bash
# session 15, call D: gather-Q after the change: rows per program, autotuning, stall reasons; M3 shapes with the
# combine back at four warps
R=$PWD; . $R/.carry/setup.sh
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
t python $X/sparse_attention_profile.py --lengths 131072 --tiles none --chunk-rows 1024,4096 > $O/prof_g4_rows.json 2>/dev/null
t python $X/sparse_attention_profile.py --lengths 131072 --heads 64 --kv-heads 4 --tiles none > $O/prof_m3.json 2>/dev/null
M3C_AUTOTUNE=1 M3C_AUTOTUNE_CACHE=0 TRITON_PRINT_AUTOTUNING=1 TO=200 t python $X/sparse_attention_profile.py --lengths 131072 --tiles none > $O/prof_g4_tuned.json 2>$O/tune_g4.log
TO=150 t /usr/local/cuda/bin/ncu --clock-control none -k regex:gather_q_fwd_kernel --launch-skip 2 --launch-count 1 \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread \
  python $X/sparse_attention_profile.py --lengths 65536 --tiles none > $O/ncu_stalls.txt 2>&1
for f in $O/prof_*.json; do echo $f; head -c 1200 $f; echo; done >&2
grep -i "best config\|Triton autotuning" $O/tune_g4.log | head -5 >&2
grep -E "stalled|inst_executed|tensor|dram__|registers" $O/ncu_stalls.txt | sed 's/  */ /g' | awk '$NF+0 > 0.05 || /inst|tensor|dram|regis/' >&2
tar -czf $OUT/s15d.tgz -C $O .
