"""New tokens, and the modules trained in full beside the adapters (`lora.modules_to_save`).

- `add_special_tokens`: the tokens of `data.add_special_tokens` that the tokenizer lacks, added as special ones.
- `grow_vocab` / `VocabResize`: when the tokenizer has outgrown the base's vocabulary, the skeleton's embedding
  and head get its rows before anything is sharded or quantized, and the loader (loading/plan.py) fills each
  new row of them with the mean of the stored ones as it streams those tensors.
- `train_in_full`: the modules `lora.modules_to_save` names, checked, stored in the master dtype and trained
  (FSDP2 then shards them like the rest and casts them to the compute dtype where they are used).
- `check_new_tokens_trained`: new tokens need the embedding and head trained.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from qshard.adapters import LoRALinear
from qshard.config import Config
from qshard.errors import QShardError
from qshard.models import architecture, cast_parameters
from qshard.precision import precision
from qshard.quant import QuantizedExperts, QuantizedLinear

log = logging.getLogger("qshard")


def add_special_tokens(tokenizer: PreTrainedTokenizerBase, tokens: list[str] | None) -> PreTrainedTokenizerBase:
    """`tokenizer` with those of `tokens` it lacks added as special tokens (never split, skipped when decoding),
    each new one taking the next id; tokens it has already, special or not, are left as they are."""
    vocab = tokenizer.get_vocab()
    new = list(dict.fromkeys(t for t in tokens or [] if t not in vocab))
    if new:
        tokenizer.add_special_tokens({"extra_special_tokens": new}, replace_extra_special_tokens=False)
    return tokenizer


def grow_vocab(cfg: Config, hf_config: PretrainedConfig, tokenizer_len: int | None) -> int | None:
    """Give `hf_config` the rows the training tokenizer needs (`tokenizer_len`, its length) when
    data.add_special_tokens made it outgrow the base's vocabulary; never fewer rows (a base padded past its
    tokenizer, as Qwen's are, keeps them). Returns the rows the base checkpoint stores if they grew, else None."""
    stored = getattr(hf_config, "vocab_size", None)  # a config that has none is refused when the model is built
    if not cfg.data.add_special_tokens or tokenizer_len is None or stored is None or tokenizer_len <= stored:
        return None
    hf_config.vocab_size = tokenizer_len
    return stored


# Where the skeleton keeps its VocabResize: the load plan and the checkpoint check read it from the model they
# are given, as every other fact about how it is stored.
_ATTRIBUTE = "qshard_vocab_resize"


@dataclass(frozen=True)
class VocabResize:
    """The embedding and head tensors (checkpoint names) that have `rows` rows in the model, `stored` in the
    base checkpoint."""

    stored: int
    rows: int
    names: frozenset[str]

    @staticmethod
    def attach(model: nn.Module, stored: int | None) -> VocabResize | None:
        """Note on the skeleton which of its vocabulary tensors (tied ones once, under their first name) have
        more rows than the checkpoint's `stored` (`grow_vocab`'s), for whatever reads its load plan (`of`); None
        when the vocabulary did not grow."""
        if stored is None:
            return None
        rows = model.get_input_embeddings().weight.shape[0]
        owners = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
        params = {id(p) for m in owners for p in m.parameters(recurse=False) if p.shape[0] == rows}
        resize = VocabResize(stored, rows, frozenset(n for n, p in model.named_parameters() if id(p) in params))
        setattr(model, _ATTRIBUTE, resize)
        return resize

    @staticmethod
    def of(model: nn.Module) -> VocabResize | None:
        return getattr(model, _ATTRIBUTE, None)

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (self.stored, *shape[1:])

    def grow(self, full: torch.Tensor) -> torch.Tensor:
        """`full` (the stored rows, or more: a random source makes the model's shape) with the new rows, each
        the mean of the stored ones, computed in fp32 and stored in `full`'s dtype."""
        kept = full[: self.stored]
        mean = kept.float().mean(dim=0).to(full.dtype)
        return torch.cat([kept, mean.expand(self.rows - self.stored, *full.shape[1:])])


def train_in_full(model: nn.Module, blocks: list[nn.Module], cfg: Config) -> list[str]:
    """Make the modules of lora.modules_to_save trainable, in the master dtype (train.precision); refuse a name
    that matches no module, or one LoRA cannot train in full here: a linear it quantizes or adapts, anything
    inside (or holding) the transformer blocks, a module with no weights. A name matches a module whose full
    name is it or ends in `.name`. Returns the full names of the modules trained."""
    wanted = cfg.lora.modules_to_save or []
    chosen: dict[str, nn.Module] = {}
    for name in wanted:
        found = {fqn: m for fqn, m in model.named_modules() if fqn == name or fqn.endswith("." + name)}
        if not found:
            raise QShardError(f"lora.modules_to_save: no module '{name}' in {architecture(model)} (modules it can "
                              f"train in full: {', '.join(_candidates(model, blocks))})")
        for fqn, module in found.items():
            _check_trainable(name, fqn, module, model, blocks)
        chosen.update(found)
    for module in chosen.values():
        cast_parameters(module, precision(cfg).master).requires_grad_(True)
    if chosen and tied(model):
        log.info("lora.modules_to_save: the embedding and the head share one weight (tie_word_embeddings): "
                 "training one trains both")
    return sorted(chosen)


def _check_trainable(name: str, fqn: str, module: nn.Module, model: nn.Module, blocks: list[nn.Module]) -> None:
    others = ", ".join(_candidates(model, blocks))
    if isinstance(module, (QuantizedLinear, QuantizedExperts, LoRALinear)):
        kind = "an adapted" if isinstance(module, LoRALinear) else "a quantized"
        raise QShardError(f"lora.modules_to_save: '{name}' is {kind} layer of the blocks ({fqn}), which the adapters "
                          f"train (lora.target_modules); modules_to_save takes modules outside them: {others}")
    inside = {id(m) for b in blocks for m in b.modules()}
    if id(module) in inside:
        raise QShardError(f"lora.modules_to_save: '{name}' ({fqn}) lies inside a transformer block, where only the "
                          f"adapters train; modules_to_save takes modules outside them: {others}")
    if any(id(m) in inside for m in module.modules()):
        raise QShardError(f"lora.modules_to_save: '{name}' ({fqn or 'the model'}) holds the transformer blocks; "
                          f"name modules outside them: {others}")
    if not any(True for _ in module.parameters()):
        raise QShardError(f"lora.modules_to_save: '{name}' ({fqn}) has no weights to train; name one of: {others}")


def _candidates(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    """Leaf names of the modules outside the blocks that hold weights of their own."""
    inside = {id(m) for b in blocks for m in b.modules()}
    return [fqn.rsplit(".", 1)[-1] for fqn, m in model.named_modules()
            if fqn and id(m) not in inside and any(True for _ in m.parameters(recurse=False))]


def tied(model: nn.Module) -> bool:
    """Whether the model's head is its embedding (tie_word_embeddings)."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def check_new_tokens_trained(model: nn.Module, cfg: Config) -> None:
    """data.add_special_tokens needs the embedding and the head trained: every new token's rows start at the
    same mean, so untrained they would stay alike, and the model could neither tell the new tokens apart in its
    input nor predict one rather than another."""
    if not cfg.data.add_special_tokens:
        return
    names = {id(m): fqn.rsplit(".", 1)[-1] for fqn, m in model.named_modules()}
    modules = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    frozen = [names[id(m)] for m in modules if not m.weight.requires_grad]
    if frozen:
        raise QShardError(
            f"data.add_special_tokens: the new tokens' rows of the embedding and head start alike (the mean of the "
            f"others) and must be trained, but {' and '.join(frozen)} would stay frozen; set lora.modules_to_save: "
            f"[{', '.join(names[id(m)] for m in modules)}] (train.train_type {cfg.train.train_type})"
        )
