"""Median step time, tok/s and peak memory of a qshard run from its metrics.jsonl (skipping warm-up)."""

import argparse
import json
import statistics


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("metrics")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    with open(args.metrics) as f:
        records = [json.loads(line) for line in f]
    steady = records[args.warmup:]
    step_s = statistics.median(r["step_time_s"] for r in steady)
    print(json.dumps({
        "system": "qshard", "steps": len(records), "median_step_s": step_s,
        "tokens_per_s": statistics.median(r["tokens"] for r in steady) / step_s,
        "peak_alloc_gib": max(r["peak_mem_gib"] for r in records),
        "losses": [round(r["loss"], 4) for r in records],
        "step_times_s": [round(r["step_time_s"], 4) for r in records],
    }))


if __name__ == "__main__":
    main()
