"""The reference stack on the same work: transformers + peft + bitsandbytes 4-bit (NF4, bf16 compute),
LoRA on every linear of the blocks, non-reentrant gradient checkpointing, AdamW. Prints one JSON line.

Optional dependencies of the benchmark only (peft, bitsandbytes with CUDA)."""

import argparse
import json
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from qshard.data import collate, load_examples


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()

    start = time.perf_counter()
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": 0})
    load_s = time.perf_counter() - start
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(r=args.rank, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train()  # gradient checkpointing only acts in training mode
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4, fused=True)
    tok = AutoTokenizer.from_pretrained(args.model)
    examples = load_examples(args.data, tok, args.seq)
    times, tokens = [], []
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        batch = collate(examples[step * args.batch:(step + 1) * args.batch], tok.pad_token_id)
        batch = {k: v.cuda() for k, v in batch.items()}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens.append(int(batch["attention_mask"].sum()))
    med = statistics.median(times[args.warmup:])
    print(json.dumps({
        "system": "transformers+peft+bnb", "load_s": load_s, "median_step_s": med,
        "tokens_per_s": statistics.median(tokens[args.warmup:]) / med,
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30, "losses": [round(float(out.loss), 4)],
    }))


if __name__ == "__main__":
    main()
