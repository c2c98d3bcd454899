"""The input embedding looked up on the host (`model.embedding_on_host`).

A frozen, untied input embedding is a row lookup of the batch's tokens; its weight (1-2 GiB at a 128k
vocabulary) need not take GPU memory for it. With the option, the skeleton notes its embedding module
(`HostEmbedding.attach`, once, refusing an embedding that trains or that the head shares); the build keeps that
module outside every FSDP2 unit and materializes it in host memory, where the loader writes its weight; the
trainer looks each batch's rows up on the host while the device runs the step before (`with_input_embeddings`,
from `Trainer._prepared`), keeps them in pinned host memory and copies each micro-batch's to the device just
before its forward (`Trainer._rows_to_device`); the model is called with `inputs_embeds` (data/batching.py,
`model_inputs`). The module's own forward does the lookup (without its hooks), so an embedding that scales its
output (Gemma 3's) stays right. Calls that pass token ids on the device (generation, one token at a time) still
work: the module copies them to the host and its rows back (`_looked_up_where_held`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from qshard.config import Config
from qshard.errors import QShardError
from qshard.vocab import tied

# Where the skeleton keeps its HostEmbedding: the build, the FSDP2 recipe, the planner and the trainer read it
# from the model they are given (as vocab.VocabResize is kept).
_ATTRIBUTE = "qshard_host_embedding"
HOST = torch.device("cpu")
# The batch key of the rows looked up on the host, which the trainer keeps there until the micro-batch's forward.
HOST_ROWS = "inputs_embeds"


@dataclass(frozen=True)
class HostEmbedding:
    """The model's input embedding module, kept in host memory, and the dtype its rows are computed in."""

    module: nn.Module
    dtype: torch.dtype
    # The module's own forward (its scaling included), called without the module's hooks: a hook that makes the
    # output require grad (transformers' enable_input_require_grads) would make the rows' copy to the device part
    # of the graph, and every backward end with a gradient copied back to the host.
    forward: Callable[[torch.Tensor], torch.Tensor]

    @staticmethod
    def attach(model: nn.Module, cfg: Config, dtype: torch.dtype) -> HostEmbedding | None:
        """With model.embedding_on_host, note the skeleton's input embedding as looked up on the host, after
        refusing (one line) an embedding that trains or that the head shares; None without the option."""
        if not cfg.model.looks_up_on_host():
            return None
        embed = model.get_input_embeddings()
        reason = _kept_on_device(model, embed, cfg)
        if reason:
            raise QShardError(f"model.embedding_on_host: {reason}; set model.embedding_on_host: false")
        record = HostEmbedding(embed, dtype, embed.forward)
        embed.forward = _looked_up_where_held(embed)
        setattr(model, _ATTRIBUTE, record)
        return record

    @staticmethod
    def of(model: nn.Module) -> HostEmbedding | None:
        return getattr(model, _ATTRIBUTE, None)

    def nbytes(self) -> int:
        """The host memory its weight (and any other tensor of the module) takes."""
        tensors = [*self.module.parameters(), *self.module.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of host `ids` as the model's embedding gives them, in the compute dtype, without grad."""
        return self.forward(ids).to(self.dtype).detach()


def embedding_on_host_choice(cfg: Config, on_gpu: bool, world_size: int, skeleton: Callable[[], nn.Module]
                             ) -> tuple[bool, str]:
    """(whether `auto` looks the embedding up on the host, why in a few words): where one process trains on one
    GPU, whose memory then holds no copy of the embedding (the rows are looked up a step ahead; docs/benchmarks.md
    has its cost in speed); not with several ranks (each would hold a whole host copy, to save its GPU what FSDP2
    leaves there: 1/N of it where it shards the embedding), under either offload (parallel.cpu_offload,
    parallel.activation_offload: runs whose host memory is spent on the offloaded tensors, where a host copy and
    pinned rows would compete with them), or where the embedding must stay with the GPU (`_kept_on_device`, asked
    of `skeleton()`, the run's model built with `auto` read as off). It depends on nothing `qshard plan --fit`
    searches but the offloads, which the search settles per setting (planner/fit.py)."""
    if not on_gpu:
        return False, "off (no GPU: nothing to save)"
    if world_size > 1:
        return False, f"off ({world_size} ranks: each would hold a host copy of its own)"
    if cfg.parallel.cpu_offload:
        return False, "off (parallel.cpu_offload spends the host's memory on the offloaded weights)"
    if cfg.parallel.offloads_activations():
        return False, "off (parallel.activation_offload spends the host's memory on the offloaded activations)"
    model = skeleton()
    reason = _kept_on_device(model, model.get_input_embeddings(), cfg)
    if reason:
        return False, f"off ({reason})"
    return True, "on (one GPU, a frozen input embedding of its own: its rows looked up on the host a step ahead)"


def _kept_on_device(model: nn.Module, embed: nn.Module, cfg: Config) -> str | None:
    """Why the embedding must stay with the GPU: it trains, or it is the head's weight; None when it need not."""
    if tied(model):
        return ("the input embedding is tied to the output head (tie_word_embeddings), whose weight the GPU needs "
                "at every step")
    if cfg.train.train_type == "full":
        return "train.train_type full trains the input embedding"
    # Before the check that the embedding trains: the new tokens' rows must (vocab.check_new_tokens_trained, which
    # runs later, would ask for the embedding to be trained, which this option then refuses).
    if cfg.data.add_special_tokens:
        return "data.add_special_tokens adds tokens whose embedding rows must train"
    if any(p.requires_grad for p in embed.parameters()):
        return "lora.modules_to_save trains the input embedding"
    return None


def _looked_up_where_held(embed: nn.Module):
    """`embed.forward` taking ids from any device: ids on another device than its weight (in host memory) are
    copied there and their rows back to the ids' device (a synchronizing copy of a few ids, as generation makes;
    the training step passes the rows themselves, looked up ahead)."""
    forward = embed.forward

    @functools.wraps(forward)
    def lookup(ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        held = embed.weight.device
        if ids.device == held:
            return forward(ids, *args, **kwargs)
        return forward(ids.to(held), *args, **kwargs).to(ids.device)

    return lookup


def host_modules(model: nn.Module) -> list[nn.Module]:
    """The modules kept in host memory, outside every FSDP2 unit: the host embedding, or none."""
    record = HostEmbedding.of(model)
    return [] if record is None else [record.module]


@contextlib.contextmanager
def set_aside(model: nn.Module) -> Iterator[None]:
    """The host embedding out of `model`'s module tree for the duration, so that materializing the rest on the
    GPU (`model.to_empty`) never allocates its weight there."""
    aside = host_modules(model)
    places = [(parent, name, child) for parent in model.modules() for name, child in parent._modules.items()
              if any(child is m for m in aside)]
    for parent, name, _ in places:
        parent._modules[name] = None
    try:
        yield
    finally:
        for parent, name, child in places:
            parent._modules[name] = child


def materialize_on_host(model: nn.Module) -> None:
    """The host embedding's parameters and buffers, empty, in host memory (the loader fills its weight)."""
    for module in host_modules(model):
        module.to_empty(device=HOST)


def buffers_on_host(model: nn.Module) -> None:
    """The host embedding's buffers (an embedding scale) back in host memory, where its weight is: the build
    puts computed buffers on the GPU."""
    for module in host_modules(model):
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != HOST:
                module._buffers[name] = buf.to(HOST)


def host_tensor_names(model: nn.Module) -> frozenset[str]:
    """The host embedding's parameter names (those of the checkpoint's tensors the loader reads into host memory)."""
    kept = {id(p) for m in host_modules(model) for p in m.parameters()}
    return frozenset(n for n, p in model.named_parameters() if id(p) in kept)


def with_input_embeddings(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host batch with, beside each of its token id tensors (`input_ids`, and KTO's mismatched rows'
    `kl.input_ids`), their embedding rows (`inputs_embeds`, `kl.inputs_embeds`) looked up on the host; the batch
    as it is without a host embedding. The ids stay: labels and counts read them."""
    record = HostEmbedding.of(model)
    if record is None:
        return batch
    rows = {k.replace("input_ids", "inputs_embeds"): record.lookup(v) for k, v in batch.items()
            if k.endswith("input_ids")}
    return {**batch, **rows}
