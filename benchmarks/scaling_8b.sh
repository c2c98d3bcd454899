#!/bin/bash
# 1 vs 2 GPUs on the 8B-shaped QLoRA run (seq 2048, LoRA r=64): tok/s per GPU at a fixed per-GPU batch,
# and the first losses at 1 and 2 GPUs on the same global batches. Usage: benchmarks/scaling_8b.sh OUT
set -euo pipefail
out=${1:-/tmp/bench-scaling}
steps=${STEPS:-8}
mkdir -p "$out"
ckpt=/tmp/llama3-8b-random
[ -f $ckpt/config.json ] || python3 -m qshard make-checkpoint --shape llama3-8b --out $ckpt --device cuda
python3 benchmarks/make_data.py --out /tmp/bench-data.jsonl --examples $((2 * steps + 4)) --tokens 2048
common="--model $ckpt --data /tmp/bench-data.jsonl --max-length 2048 --batch-size 1 --lora-rank 64 --lora.alpha 16 --data.eval_fraction 0 --max-steps $steps --optim.schedule constant --lr 1e-4 --overwrite"
run() { name=$1; shift; python3 -m qshard train $common --output-dir "$out/$name" "$@" > "$out/$name.log" 2>&1 || { tail -20 "$out/$name.log"; return 1; }; python3 benchmarks/summarize.py "$out/$name/metrics.jsonl" | sed "s/^{/{\"run\": \"$name\", /"; }
run gpu1 --nproc 1
run gpu2 --nproc 2
run gpu1-accum2 --nproc 1 --grad-accum 2
