"""Write a JSONL dataset whose examples are at least `--tokens` tokens long with the demo tokenizer, so
that a benchmark at sequence length L trains on full L-token sequences (the rest is truncated)."""

import argparse
import json
import random


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    with open(args.out, "w") as f:
        for _ in range(args.examples):
            # space-separated letters are one token each with the demo tokenizer; 10% slack for truncation
            text = " ".join(rng.choice(letters) for _ in range(int(args.tokens * 1.1)))
            f.write(json.dumps({"instruction": "Continue the letters.", "input": "", "output": text}) + "\n")


if __name__ == "__main__":
    main()
