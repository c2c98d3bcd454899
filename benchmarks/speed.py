"""Training speed on one GPU, qshard against the transformers + peft + bitsandbytes stack, in one invocation.

  python3 benchmarks/speed.py --out DIR [--seq 2048] [--batch 1] [--steps 15] [--warmup 5]
                              [--systems qshard,qshard-compiled,qshard-eager,qshard-baseline,reference,unsloth]
                              [--qshard-args "..."] [--baseline-src DIR]

Builds the random-weight Llama-3-8B-shaped checkpoint (if absent) and a dataset of full-length examples,
trains each system on exactly the same examples (LoRA r=64 alpha 16 on every block linear, NF4 base,
activation checkpointing, AdamW, constant lr), each in a fresh process, and prints one table:
(`unsloth`: benchmarks/unsloth_anchor.py's run, with Unsloth's own offloaded checkpointing; a failure of it, e.g.
Unsloth refusing the machine, is its row with the error's line)

  median step time over the steps after warm-up, tok/s, MFU, peak allocated GPU memory, ratio to the reference,
  and the first step's time (for a compiled run: the compilation, or the caches' lookup when warm); then, per
  qshard run, what its config.yaml says of the options `auto` settles (parallel.cuda_graphs: off for fewer than
  200 micro-batches, 1,000 without kept projections on torch 2.11, so speed.py's runs of fewer steps measure it only
  when given `--qshard-args "--parallel.cuda_graphs true"`).

MFU = tok/s x 6 x N / peak, as the training log line computes it (qshard.train.metrics.matmul_flops_per_token
and peak_bf16_flops), where N counts the weights of every matmul a token goes through (the blocks'
linears and the output head; not the input embedding, attention scores, or the LoRA factors) and 6 is
forward + recomputation under checkpointing + the backward to the activations (the frozen base needs no
weight gradients); peak is the GPU's dense bf16 rate (989.4 TFLOP/s for H100/H200 SXM).
Results go to DIR/results.json; benchmarks/chart.py draws them.

`qshard-baseline` is the `qshard` run with another version of qshard's code: `--baseline-src` names a directory
holding its `qshard` package, put first on the run's PYTHONPATH (everything else, this script, the data and
`--qshard-args` included, stays as it is: an option only the newer code knows fails the baseline's row). A change
measured against the code before it in one sitting (the revision, written beside the package, goes into the result):

  rm -rf .baseline && mkdir .baseline && git archive REV src | tar -x -C .baseline
  git rev-parse --short REV > .baseline/REV
  python3 benchmarks/speed.py --out OUT --systems qshard-baseline,qshard --baseline-src .baseline/src

The first system compiles with empty caches where the second may find some: compare their medians, not their first
steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


# The options qshard's `auto` settles for the run and writes into its config.yaml: what the measured run did.
SETTLED = ("parallel.cuda_graphs", "parallel.ac_save_projections", "quant.double_quant")


def settled_autos(run_dir: Path) -> dict:
    """The values the run's config.yaml holds for `SETTLED` (the settings as given, or what `auto` chose); "absent"
    for an option the run's version of qshard did not have (a `qshard-baseline` of older code)."""
    import yaml

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    return {key: saved.get(key.split(".")[0], {}).get(key.split(".")[1], "absent") for key in SETTLED}


def run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        tail = log.read_text().splitlines()[-30:]
        raise SystemExit(f"failed ({proc.returncode}): {shlex.join(cmd)}\n" + "\n".join(tail))


def flops_per_token(args) -> int:
    """Training FLOPs per token of the model's matmuls, counted as the training log line counts them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qshard.random_model import named_config
    from qshard.train.metrics import matmul_flops_per_token

    config = named_config(args.shape) if args.shape else AutoConfig.from_pretrained(args.ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return matmul_flops_per_token(model)


def gpu_peak_flops() -> tuple[str, float | None]:
    import torch

    from qshard.train.metrics import peak_bf16_flops

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return name, peak_bf16_flops(name)


def prepare_inputs(args) -> Path:
    """The random-weight checkpoint (written once) and a dataset of full-length examples; returns the data."""
    py = sys.executable
    if not args.shape and not (args.ckpt / "config.json").is_file():
        run([py, "-m", "qshard", "make-checkpoint", "--shape", "llama3-8b", "--out", str(args.ckpt), "--device",
             "cuda"], args.out / "make-checkpoint.log")
    data = args.out / "data.jsonl"
    run([py, str(HERE / "make_data.py"), "--out", str(data), "--examples", str(args.batch * args.steps + 8),
         "--tokens", str(args.seq)], args.out / "make-data.log")
    return data


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/llama3-8b-random"))
    p.add_argument("--shape", help="a named shape (e.g. llama3-70b) with random weights instead of --ckpt; qshard "
                   "only (the reference needs a checkpoint)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians (compilation, caches)")
    p.add_argument("--systems", default="qshard,qshard-compiled,reference")
    p.add_argument("--qshard-args", default="", help="extra options for every qshard run")
    p.add_argument("--unsloth-timeout-s", type=float, default=300.0, help="limit of the unsloth run")
    p.add_argument("--baseline-src", type=Path, help="the directory holding the qshard package that the "
                   "qshard-baseline system runs (e.g. an earlier commit's src/)")
    args = p.parse_args()
    if "qshard-baseline" in args.systems.split(",") and not args.baseline_src:
        p.error("--systems qshard-baseline needs --baseline-src DIR")
    if args.baseline_src and not (args.baseline_src / "qshard" / "__init__.py").is_file():
        p.error(f"--baseline-src {args.baseline_src}: no qshard package there (qshard/__init__.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare_inputs(args)
    model = ["--model.shape", args.shape] if args.shape else ["--model", str(args.ckpt)]
    base = ["-m", "qshard", "train", *model, "--data", str(data), "--overwrite",
            "--max-length", str(args.seq), "--batch-size", str(args.batch), "--max-steps", str(args.steps),
            "--lora-rank", "64", "--lora.alpha", "16", "--data.eval_fraction", "0", "--optim.schedule", "constant",
            "--lr", "1e-4", *shlex.split(args.qshard_args)]
    results = []
    for system in args.systems.split(","):
        try:
            results.append(run_system(system, args, base, data))
        except SystemExit as exc:  # one system failing still leaves the others' numbers
            print(f"{system}: {exc}", file=sys.stderr)
    report_results(results, args)


def run_system(system: str, args, base: list[str], data: Path) -> dict:
    py = sys.executable
    # qshard: its defaults (compile auto: on on a GPU with Triton); the others say compile outright.
    variants = {"qshard": [], "qshard-compiled": ["--parallel.compile", "true"],
                "qshard-eager": ["--parallel.compile", "false"], "qshard-baseline": []}
    log = args.out / f"{system}.log"
    if system == "unsloth":
        from unsloth_anchor import run_child

        return run_child(args.out, args.ckpt, args.seq, batch=args.batch, steps=args.steps, warmup=args.warmup,
                         data=str(data), timeout_s=args.unsloth_timeout_s, tag="speed")
    if system == "reference":
        cmd = [py, str(HERE / "hf_reference.py"), "--model", str(args.ckpt), "--data", str(data), "--seq",
               str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        run(cmd, log)
        result = json.loads(log.read_text().strip().splitlines()[-1])
    else:
        run_dir = args.out / system
        cmd = [py, *base, "--output-dir", str(run_dir), *variants[system]]
        env = None
        if system == "qshard-baseline":  # the other version's package first on the path
            paths = [str(args.baseline_src.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        run(cmd, log, env)
        summary = subprocess.run([py, str(HERE / "summarize.py"), str(run_dir / "metrics.jsonl"), "--warmup",
                                  str(args.warmup)], capture_output=True, text=True, check=True)
        result = json.loads(summary.stdout)
        result["system"] = system
        result["settled"] = settled_autos(run_dir)
    result["command"] = shlex.join(cmd)
    if system == "qshard-baseline":
        result["command"] = f"PYTHONPATH={shlex.quote(env['PYTHONPATH'])} {result['command']}"
        result["baseline_src"] = str(args.baseline_src)
        for where in (args.baseline_src, args.baseline_src.parent):  # the revision, where the archive step wrote it
            if (where / "REV").is_file():
                result["baseline_rev"] = (where / "REV").read_text().strip()
                break
    return result


def report_results(results: list[dict], args) -> None:
    device, peak = gpu_peak_flops()
    per_token = flops_per_token(args)
    reference = next((r for r in results if r["system"] == "transformers+peft+bnb"), None)
    for r in results:
        ok = r.get("tokens_per_s") is not None  # a failed unsloth row has no numbers
        r["mfu"] = r["tokens_per_s"] * per_token / peak if peak and ok else None
        r["vs_reference"] = r["tokens_per_s"] / reference["tokens_per_s"] if reference and ok else None
    report = {"device": device, "seq": args.seq, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
              "flops_per_token": per_token, "results": results,
              "torch": __import__("torch").__version__}
    (args.out / "results.json").write_text(json.dumps(report, indent=1))

    print(f"\n{device}, seq {args.seq}, batch {args.batch}, median of steps {args.warmup + 1}-{args.steps}")
    print("| system | median step (s) | tok/s | MFU | peak allocated GiB | vs reference | first step (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if r.get("tokens_per_s") is None:
            print(f"| {r['system']} | {r.get('status', 'failed')}: {r.get('error', '')} | - | - | - | - | - |")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
        ratio = f"{r['vs_reference']:.2f}x" if r["vs_reference"] else "-"
        first = f"{r['step_times_s'][0]:.1f}" if r.get("step_times_s") else "-"
        print(f"| {r['system']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} | {mfu} | "
              f"{r['peak_alloc_gib']:.2f} | {ratio} | {first} |")
    for r in results:
        if r.get("settled"):
            print(f"{r['system']}: " + ", ".join(f"{k} {v}" for k, v in r["settled"].items()))


if __name__ == "__main__":
    main()
