#!/usr/bin/env bash
# session 12, call E (after D staged part_aa): SmolLM2's calibrated init with index rope "tile" (index dim 128) at M3's
# block 128 / top-16, with the oracle row, alone on the GPU (call C's eval of it ran out of time beside two distills).
R=$PWD; O=/tmp/r; rm -rf $O; mkdir -p $O
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -rL $R/m3compile /tmp/pkg/ && rm -rf /tmp/pkg/m3compile/{kernels,models,passes}
for d in kernels models passes; do ln -sfn $R/$d /tmp/pkg/m3compile/$d; done
cat /tmp/m/part_aa $R/.carry/b/part_ab > /tmp/m/model.gguf
python -m pip install -q --no-index --no-deps $R/.carry/b/gguf-*.whl 2>&1 | tail -1
python $R/.carry/b/smollm2.py /tmp/m/hf --gguf /tmp/m/model.gguf 2>&1 | tail -1
mkdir -p /tmp/data && cp $R/.carry/b/*.npy /tmp/data/
export PYTHONPATH=/tmp/pkg M3C_AUTOTUNE=0; cd /tmp
M="python -m m3compile.cli"; C=/tmp/data/calib_code_smollm2.npy; E=/tmp/data/eval_code_smollm2.npy
t() { local s=$SECONDS; echo "+ ${*:1:12}" >&2; timeout ${TO:-200} "$@"; echo "  rc $? in $((SECONDS - s)) s" >&2; }
TO=60 t $M convert /tmp/m/hf /tmp/q/t128 --block-size 128 --topk 16 --dense-layers 0 --index-dim 128 --calib $C --calib-tokens 8192 --calib-device cuda --force --json > $O/t128.convert.json
TO=200 t $M eval /tmp/q/t128 --data $E --seq-len 8192 --device cuda --json > $O/t128.eval.json
python $R/.carry/merge.py $O $OUT/s12e.json
