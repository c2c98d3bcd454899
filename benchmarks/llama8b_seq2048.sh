#!/bin/bash
# One H100/H200: Llama-3-8B-shaped random-weight checkpoint, seq 2048, batch 1, LoRA r=64 on every
# block linear, activation checkpointing; qshard then the transformers+peft+bnb reference, same data.
# Usage (from the repository root, with src/ on PYTHONPATH): bash benchmarks/llama8b_seq2048.sh OUTDIR
set -euo pipefail
out=${1:-/tmp/bench}
steps=${STEPS:-12}
mkdir -p "$out"
ckpt=/tmp/llama3-8b-random
[ -f $ckpt/config.json ] || { /usr/bin/time -v python3 -m qshard make-checkpoint --shape llama3-8b --out $ckpt --device cuda 2> "$out/make.log" || { cat "$out/make.log"; exit 1; }; }
python3 benchmarks/make_data.py --out /tmp/bench-data.jsonl --examples $((steps + 4)) --tokens 2048
/usr/bin/time -v python3 -m qshard train --model $ckpt --data /tmp/bench-data.jsonl --output-dir "$out/qshard" --overwrite \
  --max-length 2048 --batch-size 1 --max-steps $steps --lora-rank 64 --lora.alpha 16 --data.eval_fraction 0 \
  --optim.schedule constant --lr 1e-4 2> "$out/qshard.log" || { tail -40 "$out/qshard.log"; exit 1; }
grep -E "Maximum resident|Elapsed" "$out/qshard.log" || true
python3 benchmarks/summarize.py "$out/qshard/metrics.jsonl" | tee "$out/results.jsonl"
if [ -z "${SKIP_REFERENCE:-}" ]; then
  python3 benchmarks/hf_reference.py --model $ckpt --data /tmp/bench-data.jsonl --seq 2048 --steps $steps 2> "$out/reference.log" | tee -a "$out/results.jsonl" || tail -20 "$out/reference.log"
fi
