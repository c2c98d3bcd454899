"""Every train type for a few steps on the Llama-3-8B-shaped random checkpoint, on one GPU, one table.

  python3 benchmarks/train_types.py --out DIR [--types qlora,lora,...] [--steps 8] [--warmup 3] [--seq 2048]
                                    [--qshard-args "..."]

Each type trains in a fresh process on the same examples (batch 1, LoRA r=64 alpha 16 on every block
linear where the type has adapters, activation checkpointing, AdamW, constant lr); the table gives the
median step time after warm-up, tok/s, peak allocated GPU memory, trainable parameters and the losses
of the first and last step. The checkpoint and data are built as benchmarks/speed.py builds them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from speed import prepare_inputs, run  # noqa: E402

TYPES = {
    "qlora": ["--train-type", "qlora"],
    "qlora-hqq4": ["--train-type", "qlora", "--quant.method", "hqq", "--quant.bits", "4"],
    "qlora-hqq2": ["--train-type", "qlora", "--quant.method", "hqq", "--quant.bits", "2"],
    "qdora": ["--train-type", "qdora"],
    "lora": ["--train-type", "lora"],
    "dora": ["--train-type", "dora"],
    "full-bf16": ["--train-type", "full", "--train.precision", "bf16"],
    "llama_pro": ["--train-type", "llama_pro"],
    # Precision and offload modes of the default type (not train types, but the same table answers for them).
    "qlora-fp16": ["--train-type", "qlora", "--train.precision", "fp16_mixed"],
    "qlora-act-offload": ["--train-type", "qlora", "--parallel.activation_offload", "true"],
    "qlora-cpu-offload": ["--train-type", "qlora", "--parallel.cpu_offload", "true"],
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/llama3-8b-random"))
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pro-blocks", type=int, default=8, help="blocks added for llama_pro")
    p.add_argument("--qshard-args", default="")
    args = p.parse_args()
    args.batch, args.shape = 1, None
    args.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    data = prepare_inputs(args)
    rows = []
    for name in args.types.split(","):
        model = args.ckpt
        if name == "llama_pro":
            model = args.out / "expanded"
            if not (model / "config.json").is_file():
                run([py, "-m", "qshard", "expand", "--model", str(args.ckpt), "--output", str(model),
                     "--new-blocks", str(args.pro_blocks)], args.out / "expand.log")
        run_dir = args.out / name
        cmd = [py, "-m", "qshard", "train", "--model", str(model), "--data", str(data), "--overwrite",
               "--output-dir", str(run_dir), "--max-length", str(args.seq), "--batch-size", "1",
               "--max-steps", str(args.steps), "--lora-rank", "64", "--lora.alpha", "16",
               "--data.eval_fraction", "0", "--optim.schedule", "constant", "--lr", "1e-4",
               "--checkpoint.every_steps", "0", *TYPES[name], *shlex.split(args.qshard_args)]
        try:
            run(cmd, args.out / f"{name}.log")
        except SystemExit as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            continue
        summary = subprocess.run([py, str(HERE / "summarize.py"), str(run_dir / "metrics.jsonl"), "--warmup",
                                  str(args.warmup)], capture_output=True, text=True, check=True)
        result = json.loads(summary.stdout)
        log = (args.out / f"{name}.log").read_text()
        trainable = next((w for line in log.splitlines() for w in [line] if "trainable params" in line), "")
        rows.append({"type": name, **result, "model_line": trainable.strip(), "command": shlex.join(cmd)})
    (args.out / "train_types.json").write_text(json.dumps(rows, indent=1))
    print(f"\nseq {args.seq}, batch 1, median of steps {args.warmup + 1}-{args.steps}")
    print("| train type | median step (s) | tok/s | peak allocated GiB | loss first -> last |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['type']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['peak_alloc_gib']:.2f} | "
              f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} |")
    for r in rows:
        print(r["type"], ":", r["model_line"][-200:])


if __name__ == "__main__":
    main()
