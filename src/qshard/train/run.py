"""`qshard train`: resolve inputs, build, train, export. The output directory is held by one run at a time
(rank 0 locks it before anything is written), gets its run files only once every input has been checked,
and summary.json (written last) marks a finished run."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch.distributed as dist
import torch.nn as nn

from qshard import checkpoint, data, demo, export, models, outputs, rundir
from qshard import config as config_mod
from qshard.build import build_model, describe, load_tokenizer, local_model_dir
from qshard.checkpoint import CheckpointManager, base_fingerprint_all_ranks, base_model_name
from qshard.config import ADAPTERLESS_TRAIN_TYPES, Config
from qshard.data import GlobalBatchSampler
from qshard.errors import QShardError
from qshard.parallel.distributed import (
    DistEnv,
    collective_errors,
    from_rank0,
    held_by_rank0,
    init_distributed,
    set_timeout,
    shutdown,
)
from qshard.train.loop import EvalResult, Trainer
from qshard.train.metrics import MetricsLog, read_until

log = logging.getLogger("qshard")

# Files that make a directory look like a finished (or running) qshard run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "adapter", "merged")


def resolve_output_dir(cfg: Config) -> Path:
    """The output directory (named now if not given); not yet checked for an earlier run (see
    `_check_not_taken`, which runs once the directory is locked)."""
    if cfg.output.dir is None:
        # Rank 0 names it: ranks reading the clock on either side of a second would disagree.
        name = [f"runs/{time.strftime('%Y%m%d-%H%M%S')}"]
        dist.broadcast_object_list(name, src=0)
        cfg.output.dir = name[0]
    path = Path(cfg.output.dir)
    if path.exists() and not path.is_dir():
        raise QShardError(f"output.dir: {path} exists and is not a directory")
    return path


def _check_not_taken(cfg: Config, path: Path) -> None:
    """A directory holding a run takes only a run that continues it, or --overwrite."""
    taken = [name for name in RUN_FILES if (path / name).exists()]
    if checkpoint.complete_checkpoints(path / "checkpoints"):
        taken.append("checkpoints")
    if taken and not cfg.output.overwrite and not _continues(cfg, path):
        raise QShardError(
            f"output.dir: {path} already holds a run ({', '.join(taken)}); choose another directory "
            "or pass --overwrite (or --resume auto to continue it)"
        )
    if _continues(cfg, path) and cfg.train.train_type not in ADAPTERLESS_TRAIN_TYPES:
        # Said now rather than after training: the adapter written at the end replaces only qshard's own.
        outputs.check_target(path / "adapter", "output.dir", "adapter")


def _continues(cfg: Config, out: Path) -> bool:
    """Whether checkpoint.resume continues the run in `out`: `auto`, or a path to one of its checkpoints."""
    choice = cfg.checkpoint.resume
    if choice in (None, "none"):
        return False
    return choice == "auto" or Path(choice).resolve().is_relative_to((out / "checkpoints").resolve())


def _demo_inputs(cfg: Config, env: DistEnv, out: Path) -> None:
    """No model and no data given: the embedded demo (tiny random Llama, local tokenizer, shipped task)."""
    demo_data = resources.files("qshard") / "demo_data"
    if cfg.data.path is None and not cfg.data.sources:
        cfg.data.path = str(demo_data / "train.jsonl")
        if cfg.data.eval_path is None:
            cfg.data.eval_path = str(demo_data / "eval.jsonl")
    if cfg.model.path is None and cfg.model.shape is None:
        model_dir = out / "demo-model"
        if env.is_main:
            demo.write_demo_model(model_dir)
        dist.barrier()
        cfg.model.path = str(model_dir)


@dataclass
class RunResult:
    out: Path
    summary: dict
    model: nn.Module | None  # the trained, still sharded model (usable while the process group lives);
    # None when the run had finished before and there was nothing to do
    preempted: bool = False


def run_training(cfg: Config) -> RunResult:
    env = init_distributed(cfg.parallel.cpu_offload, ("parallel.load_timeout_s", cfg.parallel.load_timeout_s))
    try:
        with collective_errors(env):
            return train(cfg, env)
    finally:
        shutdown()


def train(cfg: Config, env: DistEnv) -> RunResult:
    """One run, holding its output directory from before the first file is written until it ends."""
    out = resolve_output_dir(cfg)
    # Rank 0 holds the lock: the other ranks write only their checkpoint shards, and may be on other machines.
    locked = held_by_rank0(lambda: rundir.run_lock(out), env.is_main)
    with locked, rundir.writing(f"into {out}"):  # a full disk met anywhere: one line
        _check_not_taken(cfg, out)
        return _train(cfg, env, out)


def _train(cfg: Config, env: DistEnv, out: Path) -> RunResult:
    started = time.perf_counter()
    no_model = cfg.model.path is None and cfg.model.shape is None
    if (cfg.data.path is None and not cfg.data.sources) or no_model:
        if env.is_main:
            log.info("no %s given: running the embedded demo", "model" if no_model else "data")
        _demo_inputs(cfg, env, out)

    model_dir = local_model_dir(cfg, env)
    tokenizer = _tokenizer(cfg, model_dir)
    train_examples, eval_examples = data.load_datasets(cfg, tokenizer, env.local_rank, env.is_main)
    resume = checkpoint.resolve_resume(cfg, out)
    resume_state, fingerprint = None, None
    if resume is not None:  # refuse a foreign checkpoint before the model is built and loaded
        resume_state = checkpoint.read_state(resume)
        fingerprint = base_fingerprint_all_ranks(cfg, env)
        checkpoint.check_compatible(resume, resume_state, cfg, fingerprint)
    continuing = resume is not None and _continues(cfg, out)
    finished = from_rank0(lambda: (out / "summary.json").is_file(), env.is_main)
    if finished and continuing and resume_state["step"] >= _planned_steps(cfg, len(train_examples), env):
        if env.is_main:
            log.info("run already finished: %s holds summary.json and its checkpoint of the last step (%d); "
                     "nothing to do", out, resume_state["step"])
        return RunResult(out, {}, None)
    if finished and cfg.checkpoint.resume == "auto" and resume is None and not cfg.output.overwrite:
        raise QShardError(f"output.dir: {out} holds a finished run but no checkpoint to continue it from; "
                          "choose another directory or pass --overwrite")
    kept_metrics = _kept_metrics(out, resume_state["step"], env) if continuing else []
    model, report = build_model(cfg, env, model_dir)
    fingerprint = fingerprint or base_fingerprint_all_ranks(cfg, env)
    if env.is_main:
        log.info("%s | world size %d on %s", describe(model, report, cfg), env.world_size, env.device.type)
        log.info("data: %d training and %d held-out examples", len(train_examples), len(eval_examples))

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = Trainer(cfg, env, model, train_examples, eval_examples, pad_id)  # checks the data fills a batch
    assert trainer.total_steps == _planned_steps(cfg, len(train_examples), env)
    trainer.checkpoint_meta = {
        "base_model": base_model_name(cfg),
        "base_fingerprint": fingerprint,
        "world_size": env.world_size,
        "global_batch": trainer.sampler.global_batch_size,
        "config": cfg.to_dict(),
    }
    start_step, first = 0, None
    if resume_state is not None:
        load_started = time.perf_counter()
        checkpoint.load(resume, model, trainer.optimizer)
        trainer.restore(resume_state)  # schedule and loss scale
        start_step = resume_state["step"]
        if resume_state.get("eval_loss_start") is not None:
            first = EvalResult(resume_state["eval_loss_start"], 0)
        _warn_if_data_order_changes(resume_state, trainer, env)
        if env.is_main:
            log.info("resumed from %s at step %d (checkpoint loaded in %.2f s)", resume, start_step,
                     time.perf_counter() - load_started)

    checkpoints = CheckpointManager(out / "checkpoints", cfg, env.is_main, env.device)
    metrics = _open_outputs(cfg, env, out, kept_metrics, replace=cfg.output.overwrite and not continuing)
    set_timeout(env, "parallel.timeout_s", cfg.parallel.timeout_s)  # loading is over: ranks now keep in step

    def at_step() -> str:
        return f" at step {trainer.current_step}" if trainer.current_step else " before the first step"

    with _preemption_handler(trainer), collective_errors(env, at_step):
        try:
            fit = trainer.fit(metrics, start_step, checkpoints, first)
        finally:
            metrics.close()
    if fit.preempted:
        if env.is_main:
            log.info("preempted: saved step %d; continue with the same command plus --resume auto",
                     fit.records[-1]["step"] if fit.records else start_step)
        return RunResult(out, {}, model, preempted=True)

    if start_step >= trainer.total_steps and first is not None and eval_examples:
        fit.last = trainer.evaluate()  # nothing was left to train: the loaded weights' loss, not the start's
    adapter_tensors = export.gather_lora(model) if report.adapted else {}
    records, first, last = fit.records, fit.first, fit.last
    summary = {
        "train_type": cfg.train.train_type,
        "world_size": env.world_size,
        "steps": trainer.total_steps,
        "resumed_from_step": start_step or None,
        "train_loss_first": records[0]["loss"] if records else None,
        "train_loss_last": records[-1]["loss"] if records else None,
        "eval_loss_start": first.loss if first else None,
        "eval_loss_end": last.loss if last else None,
        "eval_ppl_start": first.perplexity if first else None,
        "eval_ppl_end": last.perplexity if last else None,
        "elapsed_s": time.perf_counter() - started,
        "adapter": "adapter" if report.adapted else None,
        "checkpoint": str(checkpoint.step_dir(Path("checkpoints"), trainer.total_steps)),
    }
    if env.is_main:
        if report.adapted:
            export.write_peft_adapter(out / "adapter", adapter_tensors, cfg.lora, export.target_modules(model),
                                      base_model_name(cfg))
        _write_json_atomic(out / "summary.json", summary)
        if first is not None and last is not None:
            log.info("held-out loss %.4f -> %.4f (perplexity %.2f -> %.2f)",
                     first.loss, last.loss, first.perplexity, last.perplexity)
        log.info("finished %d steps in %.1f s; results in %s", trainer.total_steps, summary["elapsed_s"], out)
    dist.barrier()
    return RunResult(out, summary, model)


def _tokenizer(cfg: Config, model_dir: Path | None):
    """The model directory's tokenizer (under broadcast loading, from files rank 0 sent), or for a named
    shape without a directory, the demo tokenizer, whose ids must fit the shape's vocabulary."""
    if cfg.model.path is None:
        from qshard.demo_tokenizer import build_demo_tokenizer
        from qshard.random_model import named_config

        vocab = named_config(cfg.model.shape).vocab_size
        tokenizer = build_demo_tokenizer()
        if len(tokenizer) > vocab:
            raise QShardError(
                f"model.shape {cfg.model.shape}: its vocabulary of {vocab} tokens is smaller than the demo "
                f"tokenizer's {len(tokenizer)}; give model.path a directory with a tokenizer that fits"
            )
        return tokenizer
    models.load_hf_config(model_dir)  # the model directory's own errors first, before the tokenizer's
    return load_tokenizer(model_dir)


def _warn_if_data_order_changes(state: dict, trainer: Trainer, env: DistEnv) -> None:
    if state.get("global_batch") != trainer.sampler.global_batch_size and env.is_main:
        log.warning(
            "the checkpoint was trained with a global batch of %s examples and this run uses %d: the data "
            "order from here differs from the original run's (keep micro_batch_size x grad_accum x world "
            "size equal to continue it exactly)", state.get("global_batch"), trainer.sampler.global_batch_size,
        )


@contextlib.contextmanager
def _preemption_handler(trainer: Trainer):
    """SIGTERM and SIGUSR1 (what SLURM sends before a kill) ask the trainer to finish the step, save and
    stop; the default handlers come back afterwards."""

    def request_stop(signum, _frame):
        trainer.stop_requested = True
        log.warning("received %s: finishing this step, then saving a checkpoint", signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _planned_steps(cfg: Config, n_examples: int, env: DistEnv) -> int:
    """The run's optimizer steps, as the Trainer will count them, known before the model is built."""
    t = cfg.train
    sampler = GlobalBatchSampler(n_examples, t.micro_batch_size, t.grad_accum, env.world_size, env.rank, t.seed)
    return t.max_steps or t.epochs * sampler.steps_per_epoch


def _kept_metrics(out: Path, step: int, env: DistEnv) -> list[str]:
    """On rank 0, the metrics lines a run resumed at `step` keeps (checked with the other inputs)."""
    kept: list[str] = []
    from_rank0(lambda: kept.extend(read_until(out / "metrics.jsonl", step)), env.is_main)
    return kept


def _open_outputs(cfg: Config, env: DistEnv, out: Path, kept: list[str], replace: bool) -> MetricsLog:
    """Only now, with every input checked, does the output directory get its run files: under --overwrite
    the previous run's are first moved aside whole. A resumed run keeps the metrics of the steps it resumes
    after; the steps past its checkpoint are redone."""
    if not env.is_main:
        return MetricsLog(None)
    if replace:
        moved = rundir.move_previous_run(out, keep=_inputs_inside(cfg, out))
        if moved is not None:
            log.info("--overwrite: moved the previous run's files to %s (delete it when no longer needed)", moved)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)  # an old finished marker must not survive
    metrics_file = out / "metrics.jsonl"
    with rundir.writing(metrics_file):
        rundir.write_atomic(metrics_file, lambda tmp: tmp.write_text("".join(line + "\n" for line in kept)))
    with rundir.writing(out / "config.yaml"):
        rundir.write_atomic(out / "config.yaml", lambda tmp: config_mod.save(cfg, tmp))
    return MetricsLog(metrics_file)


def _inputs_inside(cfg: Config, out: Path) -> set[str]:
    """The run entries of `out` that hold one of this run's inputs (the demo model it wrote there)."""
    inputs = [Path(p).resolve() for p in (cfg.model.path, cfg.data.path, cfg.data.eval_path) if p]
    return {name for name in rundir.RUN_ENTRIES
            if any(p.is_relative_to((out / name).resolve()) for p in inputs)}


def _write_json_atomic(path: Path, obj: dict) -> None:
    with rundir.writing(path):
        rundir.write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2)))
