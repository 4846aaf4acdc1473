#!/usr/bin/env bash
# session 17, call E: the whole-model plot the README shows, redrawn with today's code (session 14's was the last):
# Llama-3-8B and Qwen2.5-7B shapes, prefill 32K / 128K / 512K (512K extrapolated), decode at batch 8, 32K / 128K
R=$PWD; . $R/benchmarks/results/2026-12-02-h200-session16/setup.sh
M="python -m m3compile.cli"
TO=300 t $M bench --model llama3-8b --prefill-lengths 32K,128K,512K --decode-lengths 32K,128K --batch 8 --steps 2 --index-dim 64 --index-dtype fp8 --index-cache fp8 --out $O/model > $O/llama.log 2>&1
TO=240 t $M bench --model qwen2.5-7b --prefill-lengths 32K,128K,512K --decode-lengths 32K,128K --batch 8 --steps 2 --index-dim 64 --index-dtype fp8 --index-cache fp8 --out $O/model > $O/qwen.log 2>&1
mkdir -p $OUT/model_plot; cp $O/model/* $OUT/model_plot/; cp $O/*.log $OUT/
tail -n 22 $O/llama.log >&2; tail -n 14 $O/qwen.log >&2
