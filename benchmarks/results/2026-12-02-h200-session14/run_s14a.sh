#!/usr/bin/env bash
# session 14, call A: where gather-Q's forward spends its time at G = 4 (variants that leave a stage out), and ncu's
# view of the production kernel
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg_new && mkdir -p /tmp/pkg_new
cp -rL $R/m3compile /tmp/pkg_new/ && rm -rf /tmp/pkg_new/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg_new/m3compile/$d; done
export M3C_AUTOTUNE=0 PYTHONPATH=/tmp/pkg_new; cd /tmp
t() { local s=$SECONDS; echo "+ ${*:1:14}" >&2; timeout ${TO:-120} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
X=$R/benchmarks/experiments
TO=330 t python $X/gather_variants.py --configs 64x4x2,128x8x2,64x4x3,64x4x2x168 > $O/variants.json 2> $O/variants.err
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" >&2
TO=200 t $NCU --clock-control none -k regex:gather_q_fwd_kernel --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  python $X/gather_variants.py --length 65536 --variants base --reps 1 > $O/ncu.txt 2>&1
tail -c 3000 $O/variants.err >&2
cp $O/* $OUT/; ls -la $O >&2
