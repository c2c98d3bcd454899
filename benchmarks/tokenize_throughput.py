"""Tokenization throughput of qshard's data pipeline: generate N instruction examples as JSONL, then
time turning them into the on-disk token store that training reads (reading, decoding, chat template,
tokenizing, labels, writing), the work `qshard train` does on a cache miss.

    python benchmarks/tokenize_throughput.py --examples 1000000 --workers 2 [--file-type json]

Uses the demo tokenizer unless --model names a local model directory. `--file-type json` writes one JSON
array instead of JSONL lines (streamed record by record). Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

from qshard.data.dataset import Source, build_store
from qshard.data.store import TokenStore
from qshard.data.tokenize import make_options

WORDS = ["the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "was", "by", "at", "an",
         "be", "this", "from", "or", "have", "one", "had"]


def write_dataset(path: Path, n: int, seed: int = 0) -> None:
    """JSONL, or for a .json path one array with a record per line."""
    rng = random.Random(seed)
    array = path.suffix == ".json"
    with path.open("w") as f:
        f.write("[\n" if array else "")
        for i in range(n):
            record = {
                "instruction": " ".join(rng.choices(WORDS, k=rng.randint(4, 16))).capitalize() + "?",
                "input": " ".join(rng.choices(WORDS, k=rng.randint(0, 24))),
                "output": " ".join(rng.choices(WORDS, k=rng.randint(8, 48))) + f" {i}.",
            }
            f.write(json.dumps(record) + ("," if array and i < n - 1 else "") + "\n")
        f.write("]\n" if array else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--model", help="local model directory whose tokenizer to use (default: the demo's)")
    parser.add_argument("--file-type", choices=["jsonl", "json"], default="jsonl")
    args = parser.parse_args()

    if args.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        from qshard.demo_tokenizer import build_demo_tokenizer

        tokenizer = build_demo_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / f"train.{args.file_type}"
        start = time.perf_counter()
        write_dataset(data, args.examples)
        generate_s = time.perf_counter() - start
        source = Source(str(data), 1.0, make_options(args.max_length))
        start = time.perf_counter()
        build_store(source, tokenizer, Path(tmp) / "store", args.workers, progress=False)
        seconds = time.perf_counter() - start
        store = TokenStore(Path(tmp) / "store")
        tokens = int(store.offsets[-1])
        result = {
            "examples": len(store), "tokens": tokens, "workers": args.workers, "file_type": args.file_type,
            "seconds": round(seconds, 1),
            "examples_per_s": round(len(store) / seconds), "tokens_per_s": round(tokens / seconds),
            "data_mb": round(data.stat().st_size / 1e6, 1), "generate_s": round(generate_s, 1),
            "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
