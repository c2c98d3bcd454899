#!/bin/bash
# 1 vs 2 GPUs on the 8B-shaped QLoRA run (seq 2048, LoRA r=64), in one invocation on a 2-GPU machine:
#   - tok/s per GPU at a fixed per-GPU batch (gpu1 against gpu2) and the scaling efficiency;
#   - the losses of the first steps at 1 and 2 GPUs on the same global batches (gpu2 against gpu1-accum2);
#   - with BYTES=1 (the default), the bytes all-gathered per step on 2 GPUs, NF4 base against bf16 base
#     (benchmarks/allgather_bytes.py: counted from the collectives issued, not estimated).
# Ends with a short table. Usage: benchmarks/scaling_8b.sh OUT
# Environment: STEPS (10), WARMUP (steps left out of the medians, 3: compilation), COMPILE (true),
#   BYTES (1; 0 skips the measurement), LOSSES (1; 0 skips the gpu1-accum2 run and the loss comparison),
#   CKPT (a model directory; default: --model.shape llama3-8b, random
#   weights generated on the GPU, the same values for any GPU count, so no checkpoint has to be written),
#   SHAPE (llama3-8b) and SEQ (2048): another named shape or length (llama-tiny and 64 check the script on CPU).
set -euo pipefail
out=${1:-/tmp/bench-scaling}
steps=${STEPS:-10}
warmup=${WARMUP:-3}
compile=${COMPILE:-true}
shape=${SHAPE:-llama3-8b}
seq=${SEQ:-2048}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
if [ -n "${CKPT:-}" ]; then model=(--model "$CKPT"); bytes_model=(--model "$CKPT"); else
  model=(--model.shape "$shape"); bytes_model=(--shape "$shape"); fi
# Letters the demo tokenizer (used with a named shape) reads as one token each.
python3 "$here/make_data.py" --out "$out/data.jsonl" --examples $((2 * steps + 4)) --tokens "$seq"
common=("${model[@]}" --data "$out/data.jsonl" --max-length "$seq" --batch-size 1 --lora-rank 64 --lora.alpha 16
        --data.eval_fraction 0 --max-steps "$steps" --optim.schedule constant --lr 1e-4 --overwrite
        --parallel.compile "$compile")
run() {
  name=$1; shift
  python3 -m qshard train "${common[@]}" --output-dir "$out/$name" "$@" > "$out/$name.log" 2>&1 \
    || { tail -20 "$out/$name.log"; return 1; }
  python3 "$here/summarize.py" "$out/$name/metrics.jsonl" --warmup "$warmup" \
    | sed "s/^{/{\"run\": \"$name\", /" | tee "$out/$name.summary.json"
}
run gpu1 --nproc 1
run gpu2 --nproc 2
if [ "${LOSSES:-1}" = 1 ]; then
  run gpu1-accum2 --nproc 1 --grad-accum 2  # gpu2's global batch on one GPU: the same examples per step
fi
if [ "${BYTES:-1}" = 1 ]; then
  # lora (bf16 base), qlora with NF4 sharded by FSDP2, and by DTensor buffers; eager blocks: compilation
  # changes no collective, and the counting dispatch mode is meant for eager ops.
  python3 "$here/allgather_bytes.py" "${bytes_model[@]}" --nproc 2 --seq "$seq" --lora-rank 64 --lora.alpha 16 \
    --json "$out/allgather.json" > "$out/allgather.log" 2>&1 || { tail -20 "$out/allgather.log"; exit 1; }
  grep '^|\|^all-gather' "$out/allgather.log"
fi

python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
s = {n: json.loads((out / f"{n}.summary.json").read_text()) for n in ("gpu1", "gpu2", "gpu1-accum2")
     if (out / f"{n}.summary.json").is_file()}
per_gpu1, per_gpu2 = s["gpu1"]["tokens_per_s"], s["gpu2"]["tokens_per_s"] / 2
print("\n| measure | value |\n|---|---|")
print(f"| tok/s, 1 GPU | {per_gpu1:,.0f} |")
print(f"| tok/s per GPU, 2 GPUs | {per_gpu2:,.0f} (all: {s['gpu2']['tokens_per_s']:,.0f}) |")
print(f"| scaling efficiency 1 -> 2 GPUs | {per_gpu2 / per_gpu1:.1%} (target 90%) |")
print(f"| peak allocated GiB per GPU, 1 / 2 GPUs | {s['gpu1']['peak_alloc_gib']:.2f} / {s['gpu2']['peak_alloc_gib']:.2f} |")
if "gpu1-accum2" in s:
    a, b = s["gpu2"]["losses"], s["gpu1-accum2"]["losses"]
    print(f"| first losses, 2 GPUs / 1 GPU x accum 2 | {', '.join(f'{x:.4f}/{y:.4f}' for x, y in zip(a[:4], b[:4]))} |")
    print(f"| largest loss difference, all {len(a)} steps | {max(abs(x - y) for x, y in zip(a, b)):.4f} |")
path = out / "allgather.json"
if path.is_file():
    for r in json.loads(path.read_text())["results"]:
        if r["run"] != "lora":
            q = r["ratios"]
            print(f"| all-gather bytes {r['run']} / lora (2 GPUs): block base weights, blocks, whole step "
                  f"| {q['block_base']:.3f}, {q['blocks']:.3f}, {q['total']:.3f} |")
EOF
