"""Generate the embedded demo dataset: src/qshard/demo_data/{train,eval}.jsonl.

The tasks are tiny and rule-based (reverse, sort, uppercase or count spaced letters; repeat letters N
times; add two small numbers) so that a random-weight model of a few layers, trained with LoRA for a
couple of hundred CPU steps, visibly lowers its held-out loss. Letters are space-separated so that each
one is a single token and the rules act on whole tokens rather than on arbitrary BPE pieces.

Run from the repository root:  PYTHONPATH=src python scripts/make_demo_data.py
The output is a pure function of SEED, so re-running it reproduces the committed files byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import sys
from collections.abc import Callable
from pathlib import Path

SEED = 1234
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "qshard" / "demo_data"

Item = tuple[str, str, str]  # instruction, input, output


def _letters(rng: random.Random, lo: int, hi: int) -> list[str]:
    return rng.sample(string.ascii_lowercase, rng.randint(lo, hi))


def reverse_item(rng: random.Random) -> Item:
    xs = _letters(rng, 3, 6)
    return "Reverse the letters.", " ".join(xs), " ".join(reversed(xs))


def sort_item(rng: random.Random) -> Item:
    xs = _letters(rng, 3, 6)
    return "Sort the letters.", " ".join(xs), " ".join(sorted(xs))


def upper_item(rng: random.Random) -> Item:
    xs = _letters(rng, 3, 6)
    return "Uppercase the letters.", " ".join(xs), " ".join(x.upper() for x in xs)


def count_item(rng: random.Random) -> Item:
    xs = rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))
    return "Count the letters.", " ".join(xs), str(len(xs))


def repeat_item(rng: random.Random) -> Item:
    n = rng.randint(2, 4)
    word = " ".join(_letters(rng, 1, 3))
    return f"Repeat the letters {n} times.", word, " ".join([word] * n)


def add_item(rng: random.Random) -> Item:
    a, b = rng.randint(0, 19), rng.randint(0, 19)
    return "Add the numbers.", f"{a} + {b}", str(a + b)


# (generator, train count, eval count); addition has only 400 distinct questions, hence fewer items.
TASKS: list[tuple[Callable[[random.Random], Item], int, int]] = [
    (reverse_item, 340, 34),
    (sort_item, 340, 34),
    (upper_item, 340, 34),
    (count_item, 340, 34),
    (repeat_item, 340, 34),
    (add_item, 300, 30),
]


def _unique_items(make: Callable[[random.Random], Item], n: int, rng: random.Random) -> list[Item]:
    """Draw until `n` items with distinct (instruction, input); the output is a function of those."""
    seen: set[tuple[str, str]] = set()
    items: list[Item] = []
    for _ in range(100 * n):
        item = make(rng)
        if item[:2] not in seen:
            seen.add(item[:2])
            items.append(item)
            if len(items) == n:
                return items
    raise RuntimeError(f"{make.__name__}: could not draw {n} distinct items")


def build_splits(seed: int = SEED) -> tuple[list[Item], list[Item]]:
    """Return (train, eval) items; eval questions never occur in train because each task's pool is unique."""
    rng = random.Random(seed)
    train: list[Item] = []
    held: list[Item] = []
    for make, n_train, n_eval in TASKS:
        items = _unique_items(make, n_train + n_eval, rng)
        held += items[:n_eval]
        train += items[n_eval:]
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


def write_jsonl(path: Path, items: list[Item]) -> None:
    lines = [json.dumps({"instruction": i, "input": x, "output": y}) for i, x, y in items]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", newline="\n")


def report(out_dir: Path) -> None:
    """Print sizes and token-length statistics measured with the demo tokenizer and the real loader."""
    from qshard.data import load_examples
    from qshard.demo_tokenizer import build_demo_tokenizer

    tokenizer = build_demo_tokenizer()
    print(f"demo tokenizer vocab: {len(tokenizer)}")
    for name in ("train", "eval"):
        path = out_dir / f"{name}.jsonl"
        lengths = [len(e.input_ids) for e in load_examples(path, tokenizer, max_length=10_000)]
        print(
            f"{name}: {len(lengths)} examples, {path.stat().st_size} bytes, tokens "
            f"min {min(lengths)} mean {statistics.mean(lengths):.1f} max {max(lengths)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-report", action="store_true", help="skip the token-length report")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    train, held = build_splits()
    write_jsonl(args.out_dir / "train.jsonl", train)
    write_jsonl(args.out_dir / "eval.jsonl", held)
    if not args.no_report:
        # The report needs the package; make it importable without an install.
        sys.path.insert(0, str(REPO / "src"))
        report(args.out_dir)


if __name__ == "__main__":
    main()
