"""Samples while training: greedy completions of a few prompts by the model being trained, written to
samples.jsonl (train.sample_every, train.sample_prompts, train.sample_max_new_tokens).

Generation runs on every rank (each forward gathers the sharded weights, a collective), eagerly (compiled
blocks would otherwise compile a graph per decoding length), in eval mode without gradients, and inside a
fork of the random state: a run with samples trains exactly as one without. `greedy_generate` is the loop,
usable by itself on any causal LM from transformers, sharded or not.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from qshard.config import Config, TrainConfig
from qshard.data import IGNORE_INDEX, Example
from qshard.data.templates import Encoder
from qshard.errors import QShardError
from qshard.parallel.fsdp import reshard_all

DEFAULT_PROMPTS = 4  # held-out examples sampled when train.sample_prompts is empty

# A prompt as given: plain text (a user message, or a plain-text run's text) or a conversation.
Prompt = str | list[dict[str, str]]


# ------------------------------------------------------------------------------------------ prompts as given


def read_prompts(t: TrainConfig) -> list[Prompt] | None:
    """train.sample_prompts read (a file) or taken as they are (a list); None when it is empty. Read before
    anything is loaded, so that an unreadable file is one error line."""
    given = t.sample_prompts
    if given is None:
        return None
    if isinstance(given, list):
        prompts: list[Prompt] = list(given)
    else:
        prompts = _read_file(Path(given))
    if not prompts:
        raise QShardError(f"train.sample_prompts: {given} holds no prompts")
    return prompts


def _read_file(path: Path) -> list[Prompt]:
    """A .txt file (one prompt per non-empty line) or a .jsonl file ({"prompt": text} or {"messages": [...]})."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QShardError(f"train.sample_prompts: cannot read {path} ({exc})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if path.suffix.lower() == ".txt":
        return [line for _, line in lines]
    if path.suffix.lower() != ".jsonl":
        raise QShardError(f"train.sample_prompts: {path}: expected a .txt file (one prompt per line) or a .jsonl "
                          "file (a prompt or messages per line)")
    return [_jsonl_prompt(f"{path}:{n}", line) for n, line in lines]


def _jsonl_prompt(where: str, line: str) -> Prompt:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise QShardError(f"train.sample_prompts: {where}: invalid JSON ({exc})") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record["prompt"]
    messages = record.get("messages") if isinstance(record, dict) else None
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise QShardError(f"train.sample_prompts: {where}: expected {{\"prompt\": text}} or {{\"messages\": "
                          "[{\"role\": ..., \"content\": ...}, ...]}")
    return _before_last_answer(messages) or messages


def _before_last_answer(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation up to its last assistant turn (all of it when it has none)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return messages[:last]


# ------------------------------------------------------------------------------------------ prompts as tokens


def render(prompt: Prompt, encoder: Encoder, plain_text: bool) -> list[int]:
    """The token ids a prompt is given to the model as: a conversation (a string is one user message)
    rendered by the run's chat template with the assistant's turn opened; in a plain-text run, the text as
    training encodes it, without the eos."""
    if plain_text and isinstance(prompt, str):
        ids = encoder.tokenizer.encode(prompt, add_special_tokens=False)
        return ids if encoder.bos_id is None else [encoder.bos_id, *ids]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return encoder.generation_prompt(messages, "train.sample_prompts")


def held_out_prompts(examples: Sequence[Example], n: int = DEFAULT_PROMPTS) -> list[list[int]]:
    """The prompts of the first `n` held-out documents (packed sequences are split into theirs): each up to
    where its last trained span starts (the last assistant turn); where every token is trained (plain text,
    data.train_on all) there is no such place, and its first half is the prompt."""
    prompts: list[list[int]] = []
    for example in examples:
        for ids, labels in _documents(example):
            prompts.append(ids[: _last_span_start(labels)])
            if len(prompts) == n:
                return prompts
    return prompts


def _documents(example: Example) -> list[tuple[list[int], list[int]]]:
    if example.position_ids is None:
        return [(list(example.input_ids), list(example.labels))]
    starts = [i for i, p in enumerate(example.position_ids) if p == 0] + [len(example.input_ids)]
    return [(list(example.input_ids[a:b]), list(example.labels[a:b])) for a, b in zip(starts, starts[1:])]


def _last_span_start(labels: list[int]) -> int:
    starts = [i for i in range(1, len(labels)) if labels[i] != IGNORE_INDEX and labels[i - 1] == IGNORE_INDEX]
    return starts[-1] if starts else max(1, len(labels) // 2)


# ------------------------------------------------------------------------------------------------ generation


@torch.no_grad()
def greedy_generate(model: nn.Module, prompts: list[list[int]], stop_ids: Sequence[int], max_new_tokens: int,
                    pad_id: int, device: torch.device, vocab: int | None = None) -> list[list[int]]:
    """Greedy completions of `prompts` (token ids), batched (padded on the left) with a KV cache: each until one
    of `stop_ids` (left out) or `max_new_tokens`, choosing among the first `vocab` ids (the tokenizer's: an
    embedding padded past it, or larger than it, has rows no text decodes to). In a process group of several
    ranks every rank must call it with the same prompts: rank 0's choice of each token is sent to all, so that
    all run the same forwards."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out: list[torch.Tensor] = []
    cache: dict[str, Any] = {}
    cache_argument = _cache_argument(model)
    for _ in range(max_new_tokens):
        result = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                       **cache)
        cache = {cache_argument: getattr(result, cache_argument)}  # the output names it as forward does
        token = _agreed(result.logits[:, -1, :vocab].argmax(-1))
        token = torch.where(done, pad_id, token)
        out.append(token)
        done |= torch.isin(token, stops)
        if bool(done.all()):
            break
        ids, positions = token[:, None], positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    tokens = torch.stack(out, dim=1).tolist() if out else [[] for _ in prompts]
    return [_until_stop(row, set(stop_ids)) for row in tokens]


def _cache_argument(model: nn.Module) -> str:
    """What the model's forward (and its output) calls its KV cache: `cache` in newer transformers,
    `past_key_values` before (which newer ones still take, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _agreed(token: torch.Tensor) -> torch.Tensor:
    """Rank 0's tokens on every rank (ranks' logits may differ in the last bit)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(token, src=0)
    return token


def _until_stop(row: list[int], stops: set[int]) -> list[int]:
    end = next((i for i, t in enumerate(row) if t in stops), len(row))
    return row[:end]


@contextlib.contextmanager
def generating(model: nn.Module, device: torch.device):
    """Eval mode, eager, in a fork of the random state; the weights resharded after (as after evaluation).
    The trainer's next step puts the model back in training mode."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type=device.type), torch.compiler.set_stance("force_eager"):
        model.eval()
        try:
            yield
        finally:
            reshard_all(model)


# ------------------------------------------------------------------------------------------------ the sampler


@dataclass
class Samples:
    """A run's prompts, rendered once, and when to sample them (built when samples are on)."""

    prompts: list[Prompt]  # as written to samples.jsonl
    tokens: list[list[int]]
    every: int  # 0: only at the run's last step
    stop_ids: list[int]
    max_new_tokens: int
    tokenizer: Any
    pad_id: int

    def due(self, step: int, total_steps: int) -> bool:
        return (self.every and step % self.every == 0) or step == total_steps

    def generate(self, model: nn.Module, device: torch.device) -> list[dict[str, Any]]:
        """One row per prompt: the prompt and its greedy completion (special tokens left out)."""
        with generating(model, device):
            completions = greedy_generate(model, self.tokens, self.stop_ids, self.max_new_tokens, self.pad_id,
                                          device, vocab=len(self.tokenizer))
        return [{"prompt": prompt, "completion": self.tokenizer.decode(ids, skip_special_tokens=True)}
                for prompt, ids in zip(self.prompts, completions, strict=True)]


def sample_interval(t: TrainConfig) -> int | None:
    """Steps between samples (0: only at the end), or None for no samples: train.sample_every, which follows
    train.eval_every when empty."""
    if t.sample_every == 0:
        return None
    return t.eval_every if t.sample_every is None else t.sample_every


def build_samples(cfg: Config, given: list[Prompt] | None, tokenizer: Any, eval_examples: Sequence[Example],
                  stop_ids: list[int], pad_id: int, plain_text: bool) -> Samples | None:
    """The run's samples, or None when they are off: train.sample_every 0, or nothing to sample (no prompts
    given and no held-out set, with train.sample_every left to follow the evaluations)."""
    every = sample_interval(cfg.train)
    if every is None or (given is None and not eval_examples):
        return None
    if given is not None:
        encoder = Encoder(tokenizer, cfg.data.chat_template)
        prompts, tokens = given, [render(p, encoder, plain_text) for p in given]
    else:
        tokens = held_out_prompts(eval_examples)
        prompts = [tokenizer.decode(ids) for ids in tokens]
    return Samples(prompts, tokens, every, stop_ids, cfg.train.sample_max_new_tokens, tokenizer, pad_id)

