"""Profile a few qshard training steps (after warm-up) and print the top CUDA kernels and CPU ops.

  python3 benchmarks/profile_step.py --model DIR --data FILE [--seq 2048] [--steps 3] [--section.key V ...]

Options left at `auto` that `qshard train` settles from its prediction (model.embedding_on_host,
parallel.ac_save_projections) are settled the same way here; parallel.cuda_graphs auto stays off.
"""

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from qshard import config as config_mod
from qshard.build import build_model, load_tokenizer
from qshard.data import load_examples
from qshard.parallel.distributed import init_distributed
from qshard.planner.command import preflight, this_machine
from qshard.train.loop import Trainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trace", help="write a Chrome trace here")
    args, extra = p.parse_known_args()
    overrides = [("model.path", args.model), ("data.path", args.data), ("data.max_length", str(args.seq)),
                 ("lora.rank", "64"), ("lora.alpha", "16")]
    overrides += [(extra[i][2:], extra[i + 1]) for i in range(0, len(extra), 2)]
    cfg = config_mod.resolve(None, overrides)
    env = init_distributed()
    tok = load_tokenizer(args.model)
    examples = load_examples(args.data, tok, args.seq)
    preflight(cfg, this_machine(env.device, env.world_size), None, None, auto_fit=False, is_main=env.is_main)
    model, _ = build_model(cfg, env, args.model)
    trainer = Trainer(cfg, env, model, examples, [], tok.pad_token_id)
    for step in range(2):
        trainer.step(step)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for step in range(2, 2 + args.steps):
            trainer.step(step)  # its loss .item() waits for the GPU
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    sys.exit(0)


if __name__ == "__main__":
    main()
