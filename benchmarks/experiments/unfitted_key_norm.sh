#!/usr/bin/env bash
# How to start the slots of an index head wider than the dense head (models/index_init.py, UNFITTED_KEY_NORM):
# dense-llama-byte on CPU, block 16 / top-4 at 512 tokens (32 blocks), calibrated init, then 200 distillation steps
# of 2 x 512 tokens with the block loss; index dim 48 (the head dim) against 128 with the random key rows at the
# fitted rows' norm (1) and at 0.01 of it. About 4 minutes per variant on 2 cores.
#
#     benchmarks/experiments/unfitted_key_norm.sh ../shared OUT     # then OUT/<variant>.{init,dist}.json
set -eu
S=${1:?usage: unfitted_key_norm.sh SHARED_DIR OUT_DIR}; O=${2:?usage: unfitted_key_norm.sh SHARED_DIR OUT_DIR}
BY=$S/checkpoints/dense-llama-byte; C=$S/data/calib_code.bin; E=$S/data/eval_code.bin
X="python $(dirname "$0")/unfitted_key_norm.py"; mkdir -p "$O"
CV="--block-size 16 --topk 4 --dense-layers 0 --calib $C --calib-tokens 8192 --force --json"
EV="--data $E --seq-len 512 --max-windows 32 --no-oracle --json"
DI="--data $C --seq-len 512 --batch 2 --lr 1e-3 --warmup-steps 20 --checkpoint-every 100000 --device cpu --json --steps 200 --force --block-loss 1"
for v in "48 1" "128 1" "128 0.01"; do set -- $v; n=d$1_k$2
  s=$SECONDS; $X $2 convert $BY $O/$n --index-dim $1 $CV > $O/$n.convert.json
  $X $2 eval $O/$n $EV > $O/$n.init.json
  $X $2 distill $O/$n --out $O/$n-d $DI > $O/$n.distill.json
  $X $2 eval $O/$n-d $EV > $O/$n.dist.json; echo "$n done in $((SECONDS - s)) s"
done
