"""`qshard train`: resolve inputs, build, train, export; the output directory is created only once
every input has been checked, and summary.json (written last) marks a finished run."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch.distributed as dist
import torch.nn as nn

from qshard import config as config_mod
from qshard import data, demo, export, models
from qshard.build import build_model, describe, load_tokenizer
from qshard.config import Config
from qshard.errors import QShardError
from qshard.parallel.distributed import DistEnv, init_distributed, shutdown
from qshard.train.loop import Trainer
from qshard.train.metrics import MetricsLog

log = logging.getLogger("qshard")

# Files that make a directory look like a finished (or running) qshard run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "adapter")


def resolve_output_dir(cfg: Config) -> Path:
    if cfg.output.dir is None:
        # Rank 0 names it: ranks reading the clock on either side of a second would disagree.
        name = [f"runs/{time.strftime('%Y%m%d-%H%M%S')}"]
        dist.broadcast_object_list(name, src=0)
        cfg.output.dir = name[0]
    path = Path(cfg.output.dir)
    if path.exists() and not path.is_dir():
        raise QShardError(f"output.dir: {path} exists and is not a directory")
    taken = [name for name in RUN_FILES if (path / name).exists()]
    if taken and not cfg.output.overwrite:
        raise QShardError(
            f"output.dir: {path} already holds a run ({', '.join(taken)}); choose another directory "
            "or pass --overwrite"
        )
    return path


def _demo_inputs(cfg: Config, env: DistEnv, out: Path) -> None:
    """No model and no data given: the embedded demo (tiny random Llama, local tokenizer, shipped task)."""
    demo_data = resources.files("qshard") / "demo_data"
    if cfg.data.path is None:
        cfg.data.path = str(demo_data / "train.jsonl")
        if cfg.data.eval_path is None:
            cfg.data.eval_path = str(demo_data / "eval.jsonl")
    if cfg.model.path is None:
        model_dir = out / "demo-model"
        if env.is_main:
            demo.write_demo_model(model_dir)
        dist.barrier()
        cfg.model.path = str(model_dir)


@dataclass
class RunResult:
    out: Path
    summary: dict
    model: nn.Module  # the trained, still sharded model (usable while the process group lives)


def run_training(cfg: Config) -> RunResult:
    env = init_distributed()
    try:
        return train(cfg, env)
    finally:
        shutdown()


def train(cfg: Config, env: DistEnv) -> RunResult:
    started = time.perf_counter()
    out = resolve_output_dir(cfg)
    if cfg.data.path is None or cfg.model.path is None:
        if env.is_main:
            log.info("no %s given: running the embedded demo", "model" if cfg.model.path is None else "data")
        _demo_inputs(cfg, env, out)

    models.load_hf_config(cfg.model.path)  # the model directory's own errors first, before the tokenizer's
    tokenizer = load_tokenizer(cfg.model.path)
    train_examples, eval_examples = _load_data(cfg, tokenizer)
    model, report = build_model(cfg, env, cfg.model.path)
    if env.is_main:
        log.info("%s | world size %d on %s", describe(model, report, cfg), env.world_size, env.device.type)
        log.info("data: %d training and %d held-out examples", len(train_examples), len(eval_examples))

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = Trainer(cfg, env, model, train_examples, eval_examples, pad_id)  # checks the data fills a batch
    metrics = _open_outputs(cfg, env, out)
    try:
        first, last, records = trainer.fit(metrics)
    finally:
        metrics.close()

    adapter_tensors = export.gather_lora(model) if report.adapted else {}
    summary = {
        "train_type": cfg.train.train_type,
        "world_size": env.world_size,
        "steps": len(records),
        "train_loss_first": records[0]["loss"] if records else None,
        "train_loss_last": records[-1]["loss"] if records else None,
        "eval_loss_start": first.loss if first else None,
        "eval_loss_end": last.loss if last else None,
        "eval_ppl_start": first.perplexity if first else None,
        "eval_ppl_end": last.perplexity if last else None,
        "elapsed_s": time.perf_counter() - started,
        "adapter": "adapter" if report.adapted else None,
    }
    if env.is_main:
        if report.adapted:
            base = str(Path(cfg.model.path).resolve())
            export.write_peft_adapter(out / "adapter", adapter_tensors, cfg.lora, export.target_modules(model), base)
        _write_json_atomic(out / "summary.json", summary)
        if first is not None:
            log.info("held-out loss %.4f -> %.4f (perplexity %.2f -> %.2f)",
                     first.loss, last.loss, first.perplexity, last.perplexity)
        log.info("finished %d steps in %.1f s; results in %s", len(records), summary["elapsed_s"], out)
    dist.barrier()
    return RunResult(out, summary, model)


def _load_data(cfg: Config, tokenizer) -> tuple[list[data.Example], list[data.Example]]:
    examples = data.load_examples(cfg.data.path, tokenizer, cfg.data.max_length, cfg.data.format)
    if cfg.data.eval_path:
        return examples, data.load_examples(cfg.data.eval_path, tokenizer, cfg.data.max_length, cfg.data.format)
    if cfg.data.eval_fraction == 0:
        return examples, []
    return data.split_held_out(examples, cfg.data.eval_fraction, cfg.train.seed)


def _open_outputs(cfg: Config, env: DistEnv, out: Path) -> MetricsLog:
    """Only now, with every input checked, does the output directory get its run files."""
    if not env.is_main:
        return MetricsLog(None)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "metrics.jsonl"):  # --overwrite: an old finished marker must not survive
        (out / stale).unlink(missing_ok=True)
    config_mod.save(cfg, out / "config.yaml")
    return MetricsLog(out / "metrics.jsonl")


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)
