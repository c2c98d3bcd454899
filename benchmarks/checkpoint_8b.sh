#!/bin/bash
# One GPU: time to save (async, every 5 steps, and the blocking final save) and to resume the 8B-shaped
# QLoRA run (LoRA r=64 on every block linear: adapters + AdamW state). Usage: benchmarks/checkpoint_8b.sh OUT
set -euo pipefail
out=${1:-/tmp/bench-ckpt}
mkdir -p "$out"
ckpt=/tmp/llama3-8b-random
[ -f $ckpt/config.json ] || python3 -m qshard make-checkpoint --shape llama3-8b --out $ckpt --device cuda
python3 benchmarks/make_data.py --out /tmp/bench-data.jsonl --examples 24 --tokens 2048
common="--model $ckpt --data /tmp/bench-data.jsonl --output-dir $out/run --max-length 2048 --batch-size 1 --lora-rank 64 --lora.alpha 16 --data.eval_fraction 0 --save-every 5"
python3 -m qshard train $common --max-steps 10 2>&1 | grep -E "checkpoint saved|step (4|5|6|7)/|finished" | tee "$out/save.log"
du -sh $out/run/checkpoints/*
python3 -m qshard train $common --max-steps 12 --resume auto 2>&1 | grep -E "resumed|finished" | tee "$out/resume.log"
