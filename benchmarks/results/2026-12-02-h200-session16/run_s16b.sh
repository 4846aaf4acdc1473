#!/usr/bin/env bash
# session 16, call B: the local block in the combine (local_combine.py) at G = 4, 7 and 16: against the path that
# gathers every slot, combine_local_kernel's tile configs, 4096 gathered rows per program; variant B (.carry/:
# the other slots merged first, the local tile last) at G = 4; check_kernels --only sparse at full size
R=$PWD; . $R/benchmarks/results/2026-12-02-h200-session16/setup.sh
rm -rf /tmp/pkg_b && cp -rL /tmp/pkg_new /tmp/pkg_b && cp $R/.carry/_tl_sparse_slotsfirst.py /tmp/pkg_b/m3compile/kernels/_tl_sparse.py
TO=200 t python $X/local_combine.py > $O/local_g4.json 2> $O/local_g4.log
TO=120 t python $X/local_combine.py --heads 64 --kv-heads 4 --configs 64x4,64x8,128x8 --chunk-rows '' > $O/local_g16.json 2> $O/local_g16.log
TO=120 t python $X/local_combine.py --heads 28 --kv-heads 4 --configs 64x4,64x8 --chunk-rows '' > $O/local_g7.json 2> $O/local_g7.log
PYTHONPATH=/tmp/pkg_b TO=150 t python $X/local_combine.py --configs 32x4,64x8 --chunk-rows '' > $O/local_g4_slotsfirst.json 2> $O/local_g4_slotsfirst.log
TO=200 t python $R/benchmarks/check_kernels.py --only sparse --json $O/check_sparse.json > $O/check_sparse.log 2>&1
for f in local_g4 local_g16 local_g7 local_g4_slotsfirst; do echo "== $f" >&2; grep -v RESULT $O/$f.json >&2; grep RESULT $O/$f.json | cut -c8- | python -c "import json,sys; d=json.load(sys.stdin); print('share', d.get('share_of_ideal')); print('kernels', d.get('kernels_local'))" >&2; tail -3 $O/$f.log >&2; done
tail -12 $O/check_sparse.log >&2
cp $O/* $OUT/ 2>/dev/null
