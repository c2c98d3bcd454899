"""Loading benchmark on one GPU, each measurement in a fresh process, one JSON line each:

  qshard-8b   qshard's load + NF4 quantization of an 8B-shaped checkpoint from the page cache, then the
              time to the end of the first training step (seq 2048, LoRA r=64 on every block linear)
  hf-8b       transformers' from_pretrained with a 4-bit BitsAndBytesConfig, same checkpoint
  qshard-70b  a 70B-shaped QLoRA model initialized at random (no checkpoint), then one training step

Each line has the wall seconds, the process's peak resident memory (VmHWM) and GPU peak/final allocated
memory; qshard's lines also say how the checkpoint was read (`read`: reader threads, bytes of pinned staging
buffers, piece size; see `qshard.loading.ReadOptions`). Usage, from the repository root with src/ on PYTHONPATH:

  python3 benchmarks/load_8b.py --ckpt /tmp/llama3-8b-random [--only qshard-8b,hf-8b,qshard-70b]

The checkpoint is written first if absent (`qshard make-checkpoint --shape llama3-8b --device cuda`) and
read once before the timed runs, so that every system reads it from the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

GiB = 2**30


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _gpu() -> dict:
    return {"gpu_peak_gib": round(torch.cuda.max_memory_allocated() / GiB, 2),
            "gpu_final_gib": round(torch.cuda.memory_allocated() / GiB, 2)}


def _step(model, seq: int) -> float:
    """One forward/backward/AdamW step on random ids; seconds."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, 32000, (1, seq), device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.train()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_qshard(args, shape: str | None) -> dict:
    from qshard.build import build_model
    from qshard.config import Config
    from qshard.loading import ReadOptions
    from qshard.parallel.distributed import init_distributed
    from qshard.quant.nf4 import _bitsandbytes

    env = init_distributed()
    cfg = Config()
    cfg.lora.rank, cfg.lora.alpha = 64, 16.0
    if shape:
        cfg.model.shape = shape
    _bitsandbytes()  # imported on first use since f67c9cc: not part of the load timed here, as before
    rss0 = _status("VmRSS")
    torch.cuda.synchronize()
    start = time.perf_counter()
    model, report = build_model(cfg, env, None if shape else args.ckpt)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    result = {"system": f"qshard-{'70b' if shape else '8b'}", "load_s": round(load_s, 2),
              "peak_rss_gib": round(_status("VmHWM") / GiB, 2), "rss_before_gib": round(rss0 / GiB, 2),
              "nf4_modules": len(report.quantized), **_gpu()}
    if not shape:
        read = ReadOptions.for_device(env.device)
        result["read"] = {"threads": read.threads, "staging_mib": read.in_flight_bytes >> 20 if read.staged else 0,
                          "piece_mib": read.piece_bytes >> 20}
    step_s = _step(model, args.seq)
    result.update(first_step_s=round(step_s, 2), time_to_first_step_s=round(load_s + step_s, 2),
                  peak_rss_after_step_gib=round(_status("VmHWM") / GiB, 2))
    return result


def run_hf(args) -> dict:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_use_double_quant=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.ckpt, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": 0})
    torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    result = {"system": "hf-8b", "load_s": round(load_s, 2), "peak_rss_gib": round(_status("VmHWM") / GiB, 2),
              **_gpu()}
    try:
        from peft import LoraConfig, get_peft_model

        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()  # checkpointed blocks over a frozen embedding need a grad input
        model = get_peft_model(model, LoraConfig(r=64, lora_alpha=16, target_modules="all-linear"))
        step_s = _step(model, args.seq)
        result.update(first_step_s=round(step_s, 2), time_to_first_step_s=round(load_s + step_s, 2))
    except ImportError:
        pass
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="/tmp/llama3-8b-random")
    parser.add_argument("--only", default="qshard-8b,hf-8b,qshard-70b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        result = {"qshard-8b": lambda: run_qshard(args, None), "hf-8b": lambda: run_hf(args),
                  "qshard-70b": lambda: run_qshard(args, "llama3-70b")}[args.phase]()
        result.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
        print(json.dumps(result), flush=True)
        return

    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "qshard", "make-checkpoint", "--shape", "llama3-8b", "--out", str(ckpt),
                        "--device", "cuda"], check=True)
    for f in sorted(ckpt.glob("*.safetensors")):  # into the page cache
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    for phase in args.only.split(","):
        if phase.endswith("8b") and not (ckpt / "config.json").is_file():
            continue
        proc = subprocess.run([sys.executable, __file__, "--phase", phase, "--ckpt", str(ckpt), "--seq", str(args.seq)],
                              capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "8"})
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode or not lines:
            print(json.dumps({"system": phase, "error": proc.stderr[-2000:]}), flush=True)
        else:
            print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
