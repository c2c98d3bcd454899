"""From a model directory (or a named shape) to a sharded, loaded, trainable model, in the order FSDP2
wants: skeleton on meta -> module swaps -> checkpoint check -> checkpointing + fully_shard -> materialize
this rank's shards -> stream weights (from the files, from rank 0, or random) -> initialize adapters."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from qshard import loading, models, vocab
from qshard.config import DORA_TRAIN_TYPES, Config
from qshard.errors import QShardError
from qshard.hf_config import load_hf_config, refuse_model_code
from qshard.host_embedding import HostEmbedding, buffers_on_host, materialize_on_host, set_aside
from qshard.loading.hub import HubModel, has_weights, hub_model, resolve, resolve_on_nodes
from qshard.models import SwapReport
from qshard.parallel.compile import decide_compile
from qshard.parallel.distributed import DistEnv, from_rank0
from qshard.parallel.fsdp import parallelize, resident_embedding_and_head
from qshard.parallel.mesh import build_mesh
from qshard.precision import precision
from qshard.random_model import named_config

log = logging.getLogger("qshard")


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The model directory's tokenizer, by transformers' own classes only (never code from the directory)."""
    refuse_model_code(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as exc:
        raise QShardError(f"{model_dir}: cannot load its tokenizer ({exc})") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise QShardError(f"{model_dir}: the tokenizer defines neither a pad nor an eos token")
    return tokenizer


def training_tokenizer(cfg: Config, model_dir: Path | None):
    """The model directory's tokenizer (under broadcast loading, from files rank 0 sent), or for a named
    shape without a directory, the demo tokenizer, whose ids must fit the shape's vocabulary; with the tokens
    of data.add_special_tokens."""
    if cfg.model.path is None:
        from qshard.demo_tokenizer import build_demo_tokenizer
        from qshard.random_model import named_config

        rows = named_config(cfg.model.shape).vocab_size
        tokenizer = build_demo_tokenizer()
        if len(tokenizer) > rows:
            raise QShardError(
                f"model.shape {cfg.model.shape}: its vocabulary of {rows} tokens is smaller than the demo "
                f"tokenizer's {len(tokenizer)}; give model.path a directory with a tokenizer that fits"
            )
    else:
        load_hf_config(model_dir)  # the model directory's own errors first, before the tokenizer's
        tokenizer = load_tokenizer(model_dir)
    return vocab.add_special_tokens(tokenizer, cfg.data.add_special_tokens)


def model_config(cfg: Config, model_dir: str | Path | None):
    """A named shape (`model.shape`, random init only) or the model directory's config.json."""
    if cfg.model.shape is not None:
        return named_config(cfg.model.shape)
    if model_dir is None:
        raise QShardError("model.path: no model directory given (and no model.shape)")
    return load_hf_config(model_dir)


def random_init(cfg: Config) -> bool:
    return cfg.model.init == "random" or cfg.model.shape is not None  # a named shape has no checkpoint


def weight_source(cfg: Config, env: DistEnv, model_dir: str | Path | None, model: nn.Module):
    """Where the frozen weights come from: this process's files, rank 0's files, or random values."""
    if random_init(cfg):
        return loading.RandomSource(model, cfg.train.seed, env.device, precision(cfg).compute)
    if cfg.model.load_mode == "broadcast" and env.world_size > 1:
        return loading.BroadcastSource(model_dir, env.is_main, env.device)
    return loading.Checkpoint(model_dir)


def files_from_rank0(cfg: Config, env: DistEnv) -> bool:
    """Broadcast loading: only rank 0 reads the model directory; it sends the others config.json too."""
    return cfg.model.load_mode == "broadcast" and env.world_size > 1 and cfg.model.shape is None


def local_model_dir(cfg: Config, env: DistEnv) -> Path | None:
    """`model.path` (a Hub id's snapshot in the Hub cache), or under broadcast loading on ranks other than 0, a
    local directory holding rank 0's config.json and tokenizer files (a collective: call it once per run, on
    every rank)."""
    return resolve_model(cfg, env)[0]


def resolve_model(cfg: Config, env: DistEnv, commit: str | None = None,
                  weights: bool = True) -> tuple[Path | None, str | None]:
    """`local_model_dir`, and for a Hub id the commit its files are of (None for a local directory). `commit`
    pins a Hub id to the commit a checkpoint was trained from. Under broadcast loading only rank 0 needs the
    files; otherwise local rank 0 of each node downloads them for its node; without `weights` (a dry run) only
    the files that describe the model. A collective."""
    # Rank 0 decides whether the path is a Hub id (no such local path): a directory present on some nodes only
    # must not send the ranks down different paths of collectives.
    hub = from_rank0(lambda: hub_model(cfg.model.path, cfg.model.revision), env.is_main)
    if hub is None:
        if files_from_rank0(cfg, env):
            return loading.model_files_from_rank0(cfg.model.path, env.is_main), None
        return (None if cfg.model.path is None else Path(cfg.model.path)), None
    asked = hub if commit is None else HubModel(hub.repo_id, commit)
    if files_from_rank0(cfg, env):
        snapshot = Path(from_rank0(lambda: str(resolve(asked, weights=weights)), env.is_main))
        model_dir = loading.model_files_from_rank0(snapshot, env.is_main)
    else:
        snapshot = model_dir = resolve_on_nodes(asked, env.local_rank, weights)
    if env.is_main:
        pinned = "" if commit is None else ", the one the checkpoint was trained from"
        log.info("model %s: commit %s%s (%s)", hub, snapshot.name, pinned, snapshot)
    return model_dir, snapshot.name


@dataclass
class Skeleton:
    """The model on the meta device with its linears swapped for the train type's modules."""

    model: nn.Module
    blocks: list[nn.Module]
    report: SwapReport
    base_params: int  # the architecture's own parameters before any swap (tied ones once)


def skeleton(cfg: Config, model_dir: str | Path | None, world_size: int, device: torch.device,
             vocab_size: int | None = None) -> Skeleton:
    """The checks of the model that need no weights, on the meta-device skeleton: config.json, blocks, module
    swaps, the vocabulary grown to `vocab_size` (see `build_model`), the modules trained in full, and adapters
    that fit `world_size` ranks with `device`'s memory."""
    hf_config = model_config(cfg, model_dir)
    stored_vocab = vocab.grow_vocab(cfg, hf_config, vocab_size)
    model = models.build_skeleton(hf_config, cfg)
    base_params = sum(p.numel() for p in model.parameters())
    vocab.VocabResize.attach(model, stored_vocab)  # the loader grows these tensors (loading/plan.py)
    blocks = models.find_blocks(model, cfg.model.block_class)
    _check_resident_blocks(cfg, blocks)
    report = models.prepare_modules(model, blocks, cfg)
    vocab.train_in_full(model, blocks, cfg)
    HostEmbedding.attach(model, cfg, precision(cfg).compute)  # model.embedding_on_host
    vocab.check_new_tokens_trained(model, cfg)
    models.check_adapter_memory(model, cfg, world_size, models.machine_memory(device))
    return Skeleton(model, blocks, report, base_params)


def _check_resident_blocks(cfg: Config, blocks: list[nn.Module]) -> None:
    """parallel.resident_blocks counts the model's blocks (parallel/storage_offload.py, storage_groups): at most all."""
    if cfg.parallel.resident_blocks > len(blocks):
        raise QShardError(f"parallel.resident_blocks: {cfg.parallel.resident_blocks} is more than the model's "
                          f"{len(blocks)} blocks ({type(blocks[0]).__name__})")


def planned_skeleton(cfg: Config, env: DistEnv, model_dir: str | Path | None, world_size: int,
                     vocab_size: int | None = None) -> Skeleton:
    """`skeleton` for `world_size` ranks, and the checkpoint's files (index, headers, every tensor and shape)
    checked against it where this process reads them: what `build_model` checks before it reads a weight, for a
    run that stops there (`qshard train --dry-run`)."""
    planned = skeleton(cfg, model_dir, world_size, env.device, vocab_size)
    if not random_init(cfg) and weights_deferred(cfg, model_dir):
        if env.is_main:
            log.info("%s: the weights are not downloaded by a dry run; the run checks them before it trains",
                     cfg.model.path)
    elif not random_init(cfg) and (env.is_main or not files_from_rank0(cfg, env)):
        checkpoint = loading.Checkpoint(model_dir)
        try:
            loading.check_checkpoint(checkpoint, planned.model)
        finally:
            checkpoint.close()
    return planned


def weights_deferred(cfg: Config, model_dir: Path | None) -> bool:
    """Whether `model_dir` is a Hub model's snapshot without its weights: what a dry run resolves (`resolve_model`
    without weights), whose weight files the run itself checks."""
    return model_dir is not None and hub_model(cfg.model.path, cfg.model.revision) is not None and \
        not has_weights(model_dir)


def build_model(cfg: Config, env: DistEnv, model_dir: str | Path | None,
                vocab_size: int | None = None) -> tuple[nn.Module, SwapReport]:
    """`model_dir`: a directory this process can read (`local_model_dir`). `vocab_size`: the training
    tokenizer's length, which the embedding and head grow to when data.add_special_tokens made it outgrow the
    base's vocabulary. Every check that can fail on user input runs before the first weight is read."""
    cfg = decide_compile(cfg, env.device, env.is_main)
    planned = skeleton(cfg, model_dir, env.world_size, env.device, vocab_size)
    model, blocks, report = planned.model, planned.blocks, planned.report
    resize = vocab.VocabResize.of(model)
    source = weight_source(cfg, env, model_dir, model)
    if not random_init(cfg):
        loading.check_checkpoint(source, model)
    if resize is not None and env.is_main:
        log.info("vocabulary: %d -> %d rows (data.add_special_tokens); the new rows of the embedding and head start "
                 "at the mean of the others", resize.stored, resize.rows)
    if report.kept:
        log.warning("%d block linear(s) kept in %s: in_features not a multiple of quant.blocksize (%s, ...)",
                    len(report.kept), precision(cfg).compute, report.kept[0])
    mesh = build_mesh(cfg, env)
    with models.allocation_errors(model, cfg, env.device):  # resident blocks' storage (parallel.resident_blocks)
        how = parallelize(model, blocks, mesh, cfg)
    host = HostEmbedding.of(model)
    if host is not None and env.is_main:
        log.info("input embedding looked up on the host (model.embedding_on_host): %.2f GiB of host memory per rank, "
                 "none on the GPU", host.nbytes() / 2**30)
    if report.quantized and env.is_main:
        where = {"fsdp": "sharded by FSDP2", "dtensor": "sharded by DTensor buffers", "in_place": "used in place "
                 "(one device: the blocks that hold it have no FSDP2 units)"}[how]
        log.info("%s storage %s", cfg.quant.method.upper(), where)
    buffers = models.computed_buffers(model)
    # Under CPU offload FSDP2 wants the shards it manages in host memory (it pins them and copies each unit to
    # the GPU when gathering it): they are materialized there and the loader writes each rank's rows into them
    # from the device the weights were quantized on. Buffers (rotary frequencies) are computed with, on the GPU.
    with models.allocation_errors(model, cfg, env.device):
        with set_aside(model):  # an embedding looked up on the host never takes GPU memory
            model.to_empty(device=torch.device("cpu") if cfg.parallel.cpu_offload else env.device)
        materialize_on_host(model)
        for module in resident_embedding_and_head(model, cfg.parallel):  # their units do not offload
            module.to_empty(device=env.device)
    models.restore_buffers(model, buffers, env.device)
    loading.load_weights(model, source, env.device)
    with models.allocation_errors(model, cfg, env.device):
        loading.init_adapters(model, cfg.train.seed)  # each adapter in full, on the host, before it is sharded
    if cfg.parallel.cpu_offload:
        models.buffers_to(model, env.device)  # any loaded (persistent) buffer: computed with, on the GPU
    buffers_on_host(model)
    return model, report


def describe(model: nn.Module, report: SwapReport, cfg: Config) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in model.parameters())
    parts = [models.architecture(model), f"train_type={cfg.train.train_type}", f"precision={precision(cfg).name}",
             f"{trainable:,} trainable params"]
    if report.quantized:
        parts.append(f"{len(report.quantized)} {cfg.quant.method.upper()} linears")
    if report.adapted:
        kind = "DoRA" if cfg.train.train_type in DORA_TRAIN_TYPES else "LoRA"
        parts.append(f"{kind} r={cfg.lora.rank} on {len(report.adapted)} linears")
    parts.append(f"{total_params:,} stored elements")
    return ", ".join(parts)
