"""The tokenizer and generation config every export carries, so that `generate` after `apply_chat_template`
stops where training taught the model to: the chat template training rendered conversations with (the
tokenizer's own, or the built-in one chosen by data.chat_template) and an `eos_token_id` listing the tokens
that end a trained answer."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qshard.build import model_config
from qshard.config import Config, DataConfig
from qshard.data.templates import Encoder, end_of_turn_ids
from qshard.hf_config import read_json_object

GENERATION_CONFIG = "generation_config.json"
# A base's copies that the exported tokenizer and generation config replace: a stale one left beside them could
# be read instead (an old chat template file) or contradict them (an old special tokens map).
REPLACED_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                  "chat_template.json", GENERATION_CONFIG)


@dataclass
class ExportTokenizer:
    """What an export writes beside the weights for generation (see `export_tokenizer`)."""

    tokenizer: Any  # the tokenizer training used
    chat_template: str | None  # the chat template it used, saved as the tokenizer's own
    generation: dict[str, Any]  # generation_config.json's contents

    def write(self, dest: Path) -> None:
        """Write the tokenizer files and generation_config.json into `dest` (an export being staged),
        replacing the base's copies there."""
        for name in REPLACED_FILES:
            (dest / name).unlink(missing_ok=True)
        tokenizer = copy.deepcopy(self.tokenizer)  # the training tokenizer is left as it is
        tokenizer.chat_template = self.chat_template
        tokenizer.save_pretrained(dest)
        (dest / GENERATION_CONFIG).write_text(json.dumps(self.generation, indent=2) + "\n")


def export_tokenizer(cfg: Config, tokenizer: Any, model_dir: Path | None) -> ExportTokenizer:
    """From a run's configuration and the tokenizer it trained with (`build.training_tokenizer`): that
    tokenizer with the chat template training used set as its own (a plain-text run keeps the tokenizer's),
    and a generation config whose eos_token_id lists the tokens that end a trained answer, then the base's."""
    text_only = plain_text_run(cfg.data)
    encoder = Encoder(tokenizer, cfg.data.chat_template)
    # One template, as a string: an export holds plain files only (several would need a folder of them).
    if text_only:  # no conversation was rendered: the tokenizer's own, if any
        template = tokenizer.get_chat_template() if getattr(tokenizer, "chat_template", None) else None
    else:
        template = encoder.template or tokenizer.get_chat_template()
    ends = end_of_turn_ids(encoder, "text" if text_only else "chat")
    return ExportTokenizer(tokenizer, template, _generation_config(cfg, model_dir, ends))


def plain_text_run(data: DataConfig) -> bool:
    """Whether every data source of the run is declared plain text (format text): no conversation was rendered."""
    formats = [s.format for s in data.sources or []]
    if data.path or data.eval_path or not formats:
        formats.append(data.format)
    return all(f == "text" for f in formats)


def _generation_config(cfg: Config, model_dir: Path | None, ends: list[int]) -> dict[str, Any]:
    """The base's generation_config.json (or, without one, its config's special token ids) with eos_token_id
    the end tokens first, then the base's own (a token the base stops at stays a stop token)."""
    path = None if model_dir is None else Path(model_dir) / GENERATION_CONFIG
    if path is not None and path.is_file():
        generation = read_json_object(path, "the base's generation config")
    else:
        hf = model_config(cfg, model_dir)
        generation = {k: v for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if (v := getattr(hf, k, None)) is not None}
    base = generation.get("eos_token_id")
    base = [] if base is None else [base] if isinstance(base, int) else list(base)
    generation["eos_token_id"] = ends + [t for t in base if t not in ends]
    if not generation["eos_token_id"]:  # a tokenizer without eos, whose template ends a turn in plain text
        del generation["eos_token_id"]
    return generation
