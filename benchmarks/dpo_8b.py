"""DPO on one GPU at the 8B shape: pairs/s and peak memory, qshard and (with --trl) TRL's DPOTrainer + peft +
bitsandbytes on the same pairs, each in a process of its own, in one invocation.

  python3 benchmarks/dpo_8b.py --out DIR [--prompt 1024] [--completion 1024] [--steps 20] [--warmup 5]
                               [--qshard-args "--parallel.compile true"] [--trl]

The work: batch of 1 pair per optimizer step, prompt `--prompt` tokens and chosen and rejected completions of
`--completion` tokens each (space-separated letters, one token each with the demo tokenizer; cut to length by
pref.max_prompt_length and data.max_length), LoRA r=64 alpha 16 on every block linear over an NF4 base,
activation checkpointing, AdamW, constant lr, beta 0.1; the reference is the base with the adapters off in both
(qshard: a second, gradient-free forward; TRL with a peft model and no ref_model: the same).
qshard runs `model.init: random` over the shape of the random-weight checkpoint `--ckpt` (written once, as
benchmarks/speed.py writes it), which TRL loads. Prints one table (median step time after warm-up, pairs/s, peak
GPU memory) and writes DIR/results.json. --trl needs trl (1.16), peft and bitsandbytes with CUDA installed.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import run  # noqa: E402


def write_pairs(path: Path, n: int, prompt: int, completion: int, seed: int = 0) -> None:
    """`n` pairs of plain strings, each a little longer than asked (the runs cut them to length)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    text = lambda tokens: " ".join(rng.choice(letters) for _ in range(int(tokens * 1.1)))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": text(prompt), "chosen": text(completion), "rejected": text(completion)})
                    + "\n")


def qshard_run(args, data: Path) -> dict:
    out = args.out / "qshard"
    cmd = [sys.executable, "-m", "qshard", "train", "--model", str(args.ckpt), "--model.init", "random",
           "--data", str(data), "--data.eval_fraction", "0", "--output-dir", str(out), "--overwrite",
           "--train.objective", "dpo", "--pref.beta", "0.1", "--pref.max_prompt_length", str(args.prompt),
           "--data.max_length", str(args.prompt + args.completion), "--batch-size", "1",
           "--max-steps", str(args.steps), "--lora-rank", "64", "--lora.alpha", "16", "--optim.schedule", "constant",
           "--optim.warmup_steps", "0", "--lr", "5e-6", *shlex.split(args.qshard_args)]
    run(cmd, args.out / "qshard.log")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records[args.warmup:]]
    return {"system": "qshard " + args.qshard_args, "step_s": statistics.median(times),
            "peak_gib": max(r["peak_mem_gib"] for r in records)}


def trl_run(args, data: Path) -> dict:
    cmd = [sys.executable, __file__, "--trl-child", "--out", str(args.out), "--ckpt", str(args.ckpt),
           "--prompt", str(args.prompt), "--completion", str(args.completion), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--data", str(data)]
    run(cmd, args.out / "trl.log")
    return json.loads((args.out / "trl.json").read_text())


def trl_child(args) -> None:
    """TRL's DPOTrainer on the same pairs: NF4 base (bf16 compute) with peft LoRA on every linear of the blocks,
    non-reentrant gradient checkpointing, the reference by disabling the adapter (a peft model, no ref_model).
    --trl-cpu (hidden) runs it without quantization on the CPU, only to check that this code runs."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cuda = not args.trl_cpu
    if cuda:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(args.ckpt, quantization_config=quant, dtype=torch.bfloat16,
                                                     device_map={"": 0})
    else:
        model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.ckpt)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    # TRL truncates prompt + completion to max_length, keeping the start; it has no prompt limit of its own, so the
    # prompts are cut here to `--prompt` tokens (the demo tokenizer: a token per letter) as qshard's
    # pref.max_prompt_length cuts them, and the completions (TRL appends EOS) then fill max_length.
    cut = lambda text, n: " ".join(text.split()[:n])  # noqa: E731
    rows = [json.loads(line) for line in args.data.read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": cut(r["prompt"], args.prompt), "chosen": r["chosen"],
                                  "rejected": r["rejected"]} for r in rows])
    config = DPOConfig(output_dir=str(args.out / "trl"), per_device_train_batch_size=1, gradient_accumulation_steps=1,
                       max_steps=args.steps, learning_rate=5e-6, lr_scheduler_type="constant", warmup_steps=0,
                       beta=0.1, loss_type=["sigmoid"], bf16=cuda, use_cpu=not cuda,
                       gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                       max_length=args.prompt + args.completion, truncation_mode="keep_start",
                       precompute_ref_log_probs=False, eval_strategy="no", save_strategy="no", logging_steps=1,
                       report_to="none", dataloader_num_workers=0, seed=0)
    lora = LoraConfig(r=64, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")

    times: list[float] = []
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            sync()
            times.append(time.perf_counter() - self.start)

    trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora, callbacks=[StepTimes()])
    assert trainer.ref_model is None, "the reference must be the policy with its adapters disabled"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    first = trainer.train_dataset[0]
    chosen = min(len(first["prompt_ids"]) + len(first["chosen_ids"]), args.prompt + args.completion)
    result = {"system": "trl", "step_s": statistics.median(times[args.warmup:]), "steps": len(times),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
              "prompt_tokens": len(first["prompt_ids"]), "chosen_tokens": chosen - len(first["prompt_ids"]),
              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    (args.out / "trl.json").write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/llama3-8b-random"))
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--completion", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--qshard-args", default="", help="more qshard options, e.g. --parallel.compile true")
    p.add_argument("--trl", action="store_true", help="also run TRL's DPOTrainer + peft + bitsandbytes")
    p.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--trl-cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trl_child:
        trl_child(args)
        return
    if not (args.ckpt / "config.json").is_file():
        run([sys.executable, "-m", "qshard", "make-checkpoint", "--shape", "llama3-8b", "--out", str(args.ckpt),
             "--device", "cuda"], args.out / "make-checkpoint.log")
    data = args.out / "pairs.jsonl"
    write_pairs(data, args.steps + 8, args.prompt, args.completion)
    results = [qshard_run(args, data)] + ([trl_run(args, data)] if args.trl else [])
    print(f"DPO, prompt {args.prompt} + completions {args.completion} tokens, 1 pair per step")
    print(f"{'system':<40} {'step s':>8} {'pairs/s':>8} {'peak GiB':>9}")
    for r in results:
        r["pairs_per_s"] = 1 / r["step_s"]
        print(f"{r['system']:<40} {r['step_s']:>8.3f} {r['pairs_per_s']:>8.3f} {r['peak_gib']:>9.2f}")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
