#!/usr/bin/env bash
# session 16, call C: combine_local_kernel with its slot loop's loads pipelined by Triton (tl.range num_stages) instead
# of call B's one-ahead prefetch in registers: G = 4 and 16 over tile configs; variant B (.carry/: the other slots
# merged first, the local tile last) at G = 4
R=$PWD; . $R/benchmarks/results/2026-12-02-h200-session16/setup.sh
rm -rf /tmp/pkg_b && cp -rL /tmp/pkg_new /tmp/pkg_b && cp $R/.carry/_tl_sparse_slotsfirst.py /tmp/pkg_b/m3compile/kernels/_tl_sparse.py
TO=200 t python $X/local_combine.py --configs 64x4x2,64x4x3,64x4x4,32x4x3,32x4x4,64x8x3 > $O/c_g4.json 2> $O/c_g4.log
PYTHONPATH=/tmp/pkg_b TO=150 t python $X/local_combine.py --no-dense --configs 64x4x3,64x4x4,32x4x4 --chunk-rows '' > $O/c_g4_sf.json 2> $O/c_g4_sf.log
TO=150 t python $X/local_combine.py --heads 64 --kv-heads 4 --configs 64x4x3,64x4x4,32x4x4 --chunk-rows '' > $O/c_g16.json 2> $O/c_g16.log
for f in c_g4 c_g4_sf c_g16; do echo "== $f" >&2; grep -v RESULT $O/$f.json >&2; grep RESULT $O/$f.json | cut -c8- | python -c "import json,sys; d=json.load(sys.stdin); print('share', d.get('share_of_ideal')); print('kernels', d.get('kernels_local'))" >&2; grep -i error $O/$f.log | tail -3 >&2; done
cp $O/* $OUT/ 2>/dev/null
