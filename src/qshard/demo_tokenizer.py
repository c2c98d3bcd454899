"""A small tokenizer built on the fly for the embedded demo, so that nothing has to be downloaded.

It is a byte-level BPE trained on the demo dataset's own text: any string can be encoded (bytes are the
fallback), yet the demo's letters, numbers and instructions become short token sequences.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
VOCAB_SIZE = 512

# Each turn is "<|role|>\n<content>", closed by eos for the assistant (that is what the model learns to
# emit) and by a newline otherwise. Every render is a prefix of the render with one more message, which
# is what the loader relies on to find the assistant tokens.
DEMO_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- else -%}{{ '\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


def _demo_texts() -> Iterator[str]:
    """Yield every string field of the demo records, in file order (which fixes the merges)."""
    folder = resources.files("qshard") / "demo_data"
    for name in ("train.jsonl", "eval.jsonl"):
        for line in (folder / name).read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                yield from (record["instruction"], record.get("input") or "", record["output"])


def _train_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[PAD, BOS, EOS, *ROLE_TOKENS],
        # The full byte alphabet keeps every input encodable, not just characters seen in the demo.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_demo_texts(), trainer=trainer)
    return tokenizer


def build_demo_tokenizer() -> PreTrainedTokenizerFast:
    """Build the demo tokenizer (deterministic: the same vocabulary and ids on every call)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=DEMO_CHAT_TEMPLATE,
        # Decoding must give back the exact text; the cleanup would rewrite spaces before punctuation.
        clean_up_tokenization_spaces=False,
    )
