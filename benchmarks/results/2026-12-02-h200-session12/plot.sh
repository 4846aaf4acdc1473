#!/usr/bin/env bash
# loss_vs_tokens.png of this folder, from the repository root. Session 11's SmolLM2 run and this session's SmolLM2
# run printed no report (stopped by their time limits): their tokens are the steps in their logs' "interrupted after
# step N" lines (679, 780) x 2 x 8192.
S11=benchmarks/results/2026-12-01-h200-session11; S12=benchmarks/results/2026-12-02-h200-session12
python3 benchmarks/plot_quality.py benchmarks/results/2026-12-01-h200-calibrated-quality $S12/loss_vs_tokens.png \
  benchmarks/results/2026-12-01-h200-session9/quality_smollm2_block_loss.json \
  --run "index dim 128, block loss 1 (session 11)":smollm2:$S11/call3_smollm2.json:-:dw:11124736 \
  --run "index dim 128, rope tile, block loss 1 (session 12)":smollm2:$S12/call3_smollm2_tile.json:t64:t64d:12779520 \
  --run "index dim 128, block loss 1 (session 12)":byte:$S12/call1_clocks_byte.json:w64:w64d \
  --run "index dim 128, rope tile, block loss 1 (session 12)":byte:$S12/call2_byte_tile.json:t128:t128d
