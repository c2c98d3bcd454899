"""Training data: files of records -> token ids with loss labels -> batches for data parallelism.

records.py reads files (JSONL, JSON, Parquet, CSV, directories) and hf.py Hugging Face datasets (saved
directories, Arrow files, hub names); formats.py gives their fields meaning (instruction, chat, sharegpt,
text); templates.py renders them to tokens and labels; tokenize.py runs that over a source, maybe in worker
processes; store.py keeps the result on disk and cache.py manages those stores (sharing, size cap);
dataset.py puts a run's data together (cache, held-out split, source weights, packing); packing.py packs,
anew each epoch; batching.py samples and collates.
"""

from qshard.data.batching import (
    GlobalBatchSampler,
    collate,
    for_epoch,
    input_tokens,
    model_inputs,
    split_held_out,
)
from qshard.data.dataset import load_datasets
from qshard.data.example import IGNORE_INDEX, Example
from qshard.data.formats import FORMATS
from qshard.data.packing import PackedExamples, longest_positions
from qshard.data.templates import ALPACA as BUILTIN_CHAT_TEMPLATE
from qshard.data.tokenize import load_examples

__all__ = [
    "BUILTIN_CHAT_TEMPLATE",
    "FORMATS",
    "IGNORE_INDEX",
    "Example",
    "GlobalBatchSampler",
    "PackedExamples",
    "collate",
    "for_epoch",
    "input_tokens",
    "load_datasets",
    "load_examples",
    "longest_positions",
    "model_inputs",
    "split_held_out",
]
