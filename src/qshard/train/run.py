"""`qshard train`: resolve inputs, build, train, export. The output directory is held by one run at a time
(rank 0 locks it before anything is written), gets its run files only once every input has been checked,
and summary.json (written last) marks a finished run."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch.distributed as dist
import torch.nn as nn
from transformers import PreTrainedTokenizerBase

from qshard import checkpoint, data, demo, export, models, outputs, rundir
from qshard import config as config_mod
from qshard.build import (
    build_model,
    describe,
    model_config,
    planned_skeleton,
    random_init,
    resolve_model,
    skeleton,
    training_tokenizer,
    weights_deferred,
)
from qshard.checkpoint import CheckpointManager, base_fingerprint_all_ranks, base_model_name
from qshard.config import ADAPTERLESS_TRAIN_TYPES, Config
from qshard.data import Example
from qshard.data.packing import example_lengths
from qshard.errors import QShardError
from qshard.export_tokenizer import ExportTokenizer, export_tokenizer, plain_text_run
from qshard.models import SwapReport
from qshard.parallel.compile import AUTO, decide_cuda_graphs
from qshard.parallel.distributed import (
    DistEnv,
    collective_errors,
    from_rank0,
    held_by_rank0,
    init_distributed,
    set_timeout,
    shutdown,
)
from qshard.parallel.fsdp import every_checkpoint_traced
from qshard.planner.command import preflight, this_machine
from qshard.train.best import BestLoss
from qshard.train.loop import EvalResult, FitResult, Trainer
from qshard.train.metrics import MetricsLog, read_until
from qshard.train.plan import RunPlan
from qshard.train.profiler import check_profile_steps
from qshard.train.reference import load_init_adapter, precompute_reference, reference_key
from qshard.train.samples import Prompt, build_samples, read_prompts
from qshard.train.trackers import open_trackers

log = logging.getLogger("qshard")

# Files that make a directory look like a finished (or running) qshard run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "summary.json", "adapter", "merged")


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


def _demo_inputs(cfg: Config, env: DistEnv, out: Path, writer: bool) -> None:
    """No model and no data given: the embedded demo (tiny random Llama, local tokenizer, shipped task); its
    model is written into `out` by the `writer`."""
    demo_data = resources.files("qshard") / "demo_data"
    if cfg.data.path is None and not cfg.data.sources:
        cfg.data.path = str(demo_data / "train.jsonl")
        if cfg.data.eval_path is None:
            cfg.data.eval_path = str(demo_data / "eval.jsonl")
    if cfg.model.path is None and cfg.model.shape is None:
        model_dir = out / "demo-model"
        if writer:
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


def run_training(cfg: Config, dry_run: bool = False, auto_fit: bool = False) -> RunResult:
    # gloo beside NCCL only where cpu_offload is asked for; --auto-fit adds it when it chooses cpu_offload.
    env = init_distributed(cfg.parallel.cpu_offload,
                           ("parallel.load_timeout_s", cfg.parallel.load_timeout_s))
    try:
        with collective_errors(env):
            return train(cfg, env, dry_run, auto_fit)
    finally:
        shutdown()


def train(cfg: Config, env: DistEnv, dry_run: bool = False, auto_fit: bool = False) -> RunResult:
    """One run, holding its output directory from before the first file is written until it ends: the
    checkpoint it resumes from, its inputs (a Hub model at the commit that checkpoint was trained from), the
    checkpoint checked against them before anything is built, the model, training, then the adapter and
    summary.json. A dry run stops once the inputs and the checkpoint are checked and prints the plan of the
    run instead: it neither locks nor writes the output directory (the demo's model goes to a scratch one)."""
    out = resolve_output_dir(cfg)
    # Rank 0 holds the lock: the other ranks write only their checkpoint shards, and may be on other machines.
    locked = contextlib.nullcontext() if dry_run else held_by_rank0(lambda: rundir.run_lock(out), env.is_main)
    scratch = tempfile.TemporaryDirectory(prefix="qshard-dry-run-") if dry_run else contextlib.nullcontext()
    with locked, scratch as demo_home, rundir.writing(f"into {out}"):  # a full disk met anywhere: one line
        _check_not_taken(cfg, out)
        started = time.perf_counter()
        prompts = read_prompts(cfg.train)  # before anything is loaded: an unreadable file is one line
        resume = _resume_from(cfg, out)
        cfg.settle_autos()
        inputs = _inputs(cfg, env, out, _trained_commit(cfg, resume), Path(demo_home) if demo_home else None,
                         weights=not dry_run)
        _check_resume(cfg, env, resume, inputs.model_dir)
        check_profile_steps(cfg.train.profile_steps, Trainer.plan(cfg, len(inputs.train), env)[1])
        _check_held_out(cfg, inputs)
        _check_positions(cfg, env, inputs)
        if _finished_before(cfg, env, out, resume, len(inputs.train)):
            return RunResult(out, {}, None)
        if dry_run:
            _print_plan(cfg, env, out, inputs, resume)
            return RunResult(out, {}, None)
        kept = _kept_lines(out, resume.state["step"], env) if resume.continuing else _Kept()
        # Before anything is loaded: a run predicted not to fit says so now, not with an OOM minutes later.
        preflight(cfg, this_machine(env.device, env.world_size), inputs.model_dir, len(inputs.tokenizer), auto_fit,
                  env.is_main, lambda: example_lengths(inputs.train))
        _decide_cuda_graphs(cfg, env, inputs, resume)
        run = _build(cfg, env, inputs, resume, prompts)
        fit = _fit(cfg, env, out, run, kept, replace=cfg.output.overwrite and not resume.continuing)
        if fit.preempted:
            if env.is_main:
                log.info("preempted: saved step %d; continue with the same command plus --resume auto",
                         fit.records[-1]["step"] if fit.records else run.start_step)
            return RunResult(out, {}, run.model, preempted=True)
        return RunResult(out, _finish(cfg, env, out, run, fit, started, inputs.exported), run.model)


# ---------------------------------------------------------------------------------------------------------------
# The steps of a run, in order.


@dataclass
class _Inputs:
    """What a run reads before it builds anything."""

    model_dir: Path | None  # a directory this process can read (build.local_model_dir)
    tokenizer: PreTrainedTokenizerBase
    train: Sequence[Example]
    eval: Sequence[Example]
    exported: ExportTokenizer  # what the adapter carries: the tokenizer with its template, the end-of-turn ids
    commit: str | None = None  # the Hub commit model_dir holds (None: a local directory)


def _inputs(cfg: Config, env: DistEnv, out: Path, commit: str | None, demo_home: Path | None = None,
            weights: bool = True) -> _Inputs:
    """The model directory (a Hub id's at `commit`, if given), tokenizer and examples; with no model or no data
    given, the embedded demo's, whose model goes into `out`, or into `demo_home` (a dry run's scratch directory,
    each rank its own). Without `weights` (a dry run), a Hub model's weights are not downloaded."""
    no_model = cfg.model.path is None and cfg.model.shape is None
    if (cfg.data.path is None and not cfg.data.sources) or no_model:
        if env.is_main:
            log.info("no %s given: running the embedded demo", "model" if no_model else "data")
        _demo_inputs(cfg, env, demo_home or out, writer=env.is_main or demo_home is not None)
    model_dir, commit = resolve_model(cfg, env, commit, weights)
    tokenizer = training_tokenizer(cfg, model_dir)
    exported = export_tokenizer(cfg, tokenizer, model_dir)  # now: its errors must not wait for training's end
    train_examples, eval_examples = data.load_datasets(cfg, tokenizer, env.local_rank, env.is_main)
    return _Inputs(model_dir, tokenizer, train_examples, eval_examples, exported, commit)


@dataclass
class _Resume:
    """The checkpoint a run starts from (none: step 0), read and checked before the model is built."""

    path: Path | None = None
    state: dict | None = None  # its trainer_state.json
    fingerprint: str | None = None  # the base's, computed to check the checkpoint against it
    continuing: bool = False  # the checkpoint is output.dir's own: that run goes on, keeping its metrics


def _resume_from(cfg: Config, out: Path) -> _Resume:
    """checkpoint.resume's checkpoint and its state, read before the inputs: a Hub model is read at the commit
    it was trained from (`_trained_commit`)."""
    path = checkpoint.resolve_resume(cfg, out)
    if path is None:
        return _Resume()
    state = checkpoint.read_state(path)
    checkpoint.follow_saved_autos(cfg, state)
    return _Resume(path, state, continuing=_continues(cfg, out))


def _trained_commit(cfg: Config, resume: _Resume) -> str | None:
    """The Hub commit the checkpoint was trained from, when its model.path and model.revision are the ones given
    now: the run goes on with the snapshot it began with, wherever the branch has moved since (another revision
    given is resolved anew, and the base check refuses it if its weights differ)."""
    if resume.state is None:
        return None
    saved = resume.state.get("config", {}).get("model", {})
    same = saved.get("path") == cfg.model.path and saved.get("revision") == cfg.model.revision
    return resume.state.get("base_commit") if same else None


def _check_resume(cfg: Config, env: DistEnv, resume: _Resume, model_dir: Path | None) -> None:
    """Refuse the checkpoint now if it was trained from another base or with tensors these options cannot hold."""
    if resume.path is None:
        return
    if weights_deferred(cfg, model_dir):  # a dry run: the base's fingerprint needs the weights it did not fetch
        if env.is_main:
            log.info("%s: the checkpoint's base is checked against the weights when the run starts", resume.path)
        return
    resume.fingerprint = base_fingerprint_all_ranks(cfg, env, model_dir)
    checkpoint.check_compatible(resume.path, resume.state, cfg, resume.fingerprint)


def _finished_before(cfg: Config, env: DistEnv, out: Path, resume: _Resume, n_examples: int) -> bool:
    """Whether output.dir holds this run already finished (summary.json, and the checkpoint of its last step
    continued): nothing to do. A finished run that --resume auto finds no checkpoint of is refused."""
    summary = from_rank0(lambda: _summary_on_disk(out), env.is_main)
    finished = summary is not None
    total = Trainer.plan(cfg, n_examples, env)[1]
    unsaved_end = finished and summary.get("checkpoint", "") is None
    if unsaved_end and cfg.checkpoint.resume == "auto" and not cfg.output.overwrite:
        # checkpoint.at_end false: the run finished without a checkpoint of its last step, and a checkpoint
        # found here is an earlier one: continuing from it would train the finished steps again.
        done = summary.get("steps", 0)
        if done >= total:
            if env.is_main:
                log.info("run already finished: %s holds summary.json of all %d steps (no checkpoint of the last "
                         "one: checkpoint.at_end false); nothing to do", out, done)
            return True
        raise QShardError(f"output.dir: {out} holds a run finished at step {done} without a checkpoint of it "
                          "(checkpoint.at_end false), so it cannot continue to more steps; choose another directory "
                          "or pass --overwrite")
    ended = resume.state is not None and (_stopped_early(cfg, resume.state) or resume.state["step"] >= total)
    if finished and resume.continuing and ended:
        if env.is_main:
            log.info("run already finished: %s holds summary.json and its checkpoint of the last step (%d); "
                     "nothing to do", out, resume.state["step"])
        return True
    if finished and cfg.checkpoint.resume == "auto" and resume.path is None and not cfg.output.overwrite:
        raise QShardError(f"output.dir: {out} holds a finished run but no checkpoint to continue it from; "
                          "choose another directory or pass --overwrite")
    return False


def _summary_on_disk(out: Path) -> dict | None:
    """The summary.json a finished run left in `out`, or None."""
    path = out / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass
class _Run:
    """A built run: the sharded model, its trainer, and where training starts."""

    model: nn.Module
    report: SwapReport
    trainer: Trainer
    start_step: int = 0
    first: EvalResult | None = None  # a resumed run's held-out loss before training (saved with the checkpoint)


def _build(cfg: Config, env: DistEnv, inputs: _Inputs, resume: _Resume, prompts: list[Prompt] | None = None) -> _Run:
    """The sharded model and its trainer, with the resumed checkpoint's weights, optimizer state and schedule,
    and the samples it writes (train.sample_prompts as read, or None)."""
    model, report = build_model(cfg, env, inputs.model_dir, len(inputs.tokenizer))
    fingerprint = resume.fingerprint or base_fingerprint_all_ranks(cfg, env, inputs.model_dir)
    if env.is_main:
        log.info("%s | world size %d on %s", describe(model, report, cfg), env.world_size, env.device.type)
        log.info("data: %d training and %d held-out examples", len(inputs.train), len(inputs.eval))
    tokenizer = inputs.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = Trainer(cfg, env, model, inputs.train, inputs.eval, pad_id)  # checks the data fills a batch
    # Preference pairs sample the prompt of each pair's first completion.
    held_out = inputs.eval.completions() if hasattr(inputs.eval, "completions") else inputs.eval
    trainer.samples = build_samples(cfg, prompts, tokenizer, held_out, inputs.exported.generation.get(
        "eos_token_id", []), pad_id, plain_text_run(cfg.data))
    trainer.checkpoint_meta = {
        "base_model": base_model_name(cfg),
        "base_fingerprint": fingerprint,
        "base_commit": inputs.commit,
        "world_size": env.world_size,
        "global_batch": trainer.sampler.global_batch_size,
        "vocab_size": model.config.vocab_size,  # the rows its embedding has: export rebuilds the model with them
        "config": cfg.to_dict(),
    }
    _reference(cfg, trainer, inputs, fingerprint)
    run = _Run(model, report, trainer)
    if resume.path is not None:
        _restore(run, resume, env)
    return run


def _reference(cfg: Config, trainer: Trainer, inputs: _Inputs, fingerprint: str) -> None:
    """train.init_adapter's weights into the adapters, and pref.precompute_reference's log-probs, computed while
    the model is the reference still (before a resumed checkpoint is loaded)."""
    if cfg.train.init_adapter:
        adapter = load_init_adapter(cfg, trainer.model)
        if trainer.env.is_main:
            log.info("continuing the adapter %s (train.init_adapter)", adapter)
    if cfg.pref.precompute_reference:
        key = reference_key(cfg, fingerprint)
        precompute_reference(trainer, [inputs.train, inputs.eval], key, adapters_off=not cfg.train.init_adapter)


def _decide_cuda_graphs(cfg: Config, env: DistEnv, inputs: _Inputs, resume: _Resume) -> None:
    """parallel.cuda_graphs auto settled (parallel/compile.py, decide_cuda_graphs) once --auto-fit has set the other
    options, and before the model and the trainer are built from it (both pad rows for it) and config.yaml is
    written: from the training rows, the micro-batches left to run, and the model's skeleton (whether every
    checkpointed block is traced into its graph), each asked only if the answer is not settled before. A dry run
    leaves `auto` (it runs no --auto-fit, and may run where the training will not)."""
    if cfg.parallel.cuda_graphs != AUTO:
        return
    steps = Trainer.plan(cfg, len(inputs.train), env)[1]
    left = (steps - (resume.state["step"] if resume.state else 0)) * cfg.train.grad_accum

    def traced() -> bool:
        planned = skeleton(cfg, inputs.model_dir, env.world_size, env.device, len(inputs.tokenizer))
        return every_checkpoint_traced(planned.model, planned.blocks, env.world_size, cfg)

    decide_cuda_graphs(cfg, env.device, env.world_size, lambda: example_lengths(inputs.train), left, traced,
                       env.is_main)


def _print_plan(cfg: Config, env: DistEnv, out: Path, inputs: _Inputs, resume: _Resume) -> None:
    """A dry run's last step: the model checked on the meta device against its files, the batch against the data
    for the world size the run would have (`parallel.nproc` ranks when not started yet), and the plan printed."""
    world = env.world_size if env.world_size > 1 else cfg.parallel.nproc
    planned = planned_skeleton(cfg, env, inputs.model_dir, world, len(inputs.tokenizer))
    sampler, steps = Trainer.plan(cfg, len(inputs.train), dataclasses.replace(env, world_size=world, rank=0))
    plan = RunPlan(cfg, planned, world, inputs.train, inputs.eval, steps, sampler.steps_per_epoch, out,
                   resume.path, resume.state["step"] if resume.state else 0)
    if env.is_main:
        print("\n".join(plan.lines()), flush=True)


def _restore(run: _Run, resume: _Resume, env: DistEnv) -> None:
    """The checkpoint's weights and optimizer state, its schedule and loss scale, and the step it saved."""
    load_started = time.perf_counter()
    checkpoint.load(resume.path, run.model, run.trainer.optimizer)
    run.trainer.restore(resume.state)
    run.start_step = resume.state["step"]
    if resume.state.get("eval_loss_start") is not None:
        run.first = EvalResult(resume.state["eval_loss_start"], 0)
    _warn_if_data_order_changes(resume.state, run.trainer, env)
    if env.is_main:
        log.info("resumed from %s at step %d (checkpoint loaded in %.2f s)", resume.path, run.start_step,
                 time.perf_counter() - load_started)


def _fit(cfg: Config, env: DistEnv, out: Path, run: _Run, kept: _Kept, replace: bool) -> FitResult:
    """The run files written, then training under the training timeout: SIGTERM or SIGUSR1 stop it after a
    saved step, and a collective that fails names the step."""
    trainer = run.trainer
    checkpoints = CheckpointManager(out / "checkpoints", cfg, env.is_main, env.device)
    metrics = _open_outputs(cfg, env, out, kept, replace, run.start_step, samples=run.trainer.samples is not None)
    set_timeout(env, "parallel.timeout_s", cfg.parallel.timeout_s)  # loading is over: ranks now keep in step

    def at_step() -> str:
        return f" at step {trainer.current_step}" if trainer.current_step else " before the first step"

    with _preemption_handler(trainer), collective_errors(env, at_step):
        try:
            return trainer.fit(metrics, run.start_step, checkpoints, run.first)
        finally:
            metrics.close()


def _finish(cfg: Config, env: DistEnv, out: Path, run: _Run, fit: FitResult, started: float,
            exported: ExportTokenizer) -> dict:
    """The adapter (gathered from every rank) with the tokenizer and generation config, then summary.json,
    written last: it marks the run finished."""
    trainer = run.trainer
    nothing_trained = run.start_step >= trainer.total_steps or (fit.stopped_early and not fit.records)
    if nothing_trained and run.first is not None and trainer.eval_examples:
        fit.last = trainer.evaluate()  # nothing was left to train: the loaded weights' loss, not the start's
    if cfg.output.adapter_from == "best":
        _load_best(out, run, fit)
    adapter_tensors = export.gather_lora(run.model) if run.report.adapted else {}
    summary = _summary(cfg, env, run, fit, started)
    if env.is_main:
        if run.report.adapted:
            export.write_peft_adapter(out / "adapter", adapter_tensors, cfg.lora, export.target_modules(run.model),
                                      base_model_name(cfg), exported,
                                      revision=trainer.checkpoint_meta["base_commit"],
                                      saved_modules=export.modules_to_save(run.model))
        _write_json_atomic(out / "summary.json", summary)
        first, last = fit.first, fit.last
        if first is not None and last is not None:
            log.info("held-out loss %s -> %s", first.describe(), last.describe())
        log.info("finished %d steps in %.1f s; results in %s (draw them: qshard plot %s)", _last_step(run, fit),
                 summary["elapsed_s"], out, out)
    dist.barrier()
    return summary


def _stopped_early(cfg: Config, state: dict) -> bool:
    """Whether a checkpoint's run had stopped early, judged with this run's patience (a larger one goes on)."""
    best = BestLoss(cfg.train.early_stopping_patience)
    best.restore(state.get("best"))
    return best.exhausted


def _last_step(run: _Run, fit: FitResult) -> int:
    """The step training ended at: the last one, or the one early stopping stopped at."""
    return fit.records[-1]["step"] if fit.records else run.start_step


def _load_best(out: Path, run: _Run, fit: FitResult) -> None:
    """output.adapter_from: best: the best step's weights, read back (on every rank) from the checkpoint
    checkpoint.keep_best kept, unless the last step is the best."""
    best = run.trainer.best.step
    if best is None or best == _last_step(run, fit):
        return
    path = checkpoint.step_dir(out / "checkpoints", best)
    if not (path / checkpoint.STATE_FILE).is_file():
        raise QShardError(f"output.adapter_from: best: the best step's checkpoint {path} is gone; the last "
                          f"step's checkpoint is kept, export it with qshard export adapter --checkpoint")
    checkpoint.load(path, run.model, optimizer=None)
    if run.trainer.env.is_main:
        log.info("adapter/ holds the best step's weights (step %d, held-out loss %.4f), from %s",
                 best, run.trainer.best.loss, path)


def _check_held_out(cfg: Config, inputs: _Inputs) -> None:
    """The options that judge held-out losses need held-out examples (the data may have given none)."""
    on = [name for name, wanted in (("train.early_stopping_patience", cfg.train.early_stopping_patience > 0),
                                    ("checkpoint.keep_best", cfg.checkpoint.keep_best)) if wanted]
    if on and not inputs.eval:
        raise QShardError(f"{on[0]}: the data gave no held-out examples (data.eval_path, data.eval_fraction)")


def _check_positions(cfg: Config, env: DistEnv, inputs: _Inputs) -> None:
    """No sequence beyond the positions the pretrained model covers (models.position_limit). Random weights
    learned no positions, so nothing is refused for them. And a warning where attention would build a mask of
    O(max_length^2) (models.warn_dense_mask; none for preference pairs the model runs as shared rows)."""
    hf_config = model_config(cfg, inputs.model_dir)
    if env.is_main:
        models.warn_dense_mask(cfg, models.shares_prompt(cfg, hf_config, cfg.model.attn_implementation))
    if random_init(cfg):
        return
    longest = max(data.longest_positions(inputs.train), data.longest_positions(inputs.eval))
    models.check_positions(hf_config, longest, cfg.data.max_length)


def _summary(cfg: Config, env: DistEnv, run: _Run, fit: FitResult, started: float) -> dict:
    """summary.json's fields: what was trained, the first and last losses, the time taken, where the results are."""
    records, first, last = fit.records, fit.first, fit.last
    # A preference loss is no token cross-entropy: its exponential is no perplexity.
    perplexity = cfg.train.objective == "sft"
    end = checkpoint.step_dir(Path("checkpoints"), _last_step(run, fit))
    return {
        "train_type": cfg.train.train_type,
        "objective": cfg.train.objective,
        "world_size": env.world_size,
        "steps": run.trainer.total_steps,
        "resumed_from_step": run.start_step or None,
        "train_loss_first": records[0]["loss"] if records else None,
        "train_loss_last": records[-1]["loss"] if records else None,
        "eval_loss_start": first.loss if first else None,
        "eval_loss_end": last.loss if last else None,
        "eval_ppl_start": first.perplexity if first and perplexity else None,
        "eval_ppl_end": last.perplexity if last and perplexity else None,
        # A preference objective's held-out metrics after training (eval_rewards_accuracy, ...).
        **({f"eval_{k}_end": v for k, v in last.metrics.items()} if last else {}),
        "elapsed_s": time.perf_counter() - started,
        "adapter": "adapter" if run.report.adapted else None,
        # None where nothing saved the last step (checkpoint.at_end false, no periodic or best save on it)
        "checkpoint": str(end) if (Path(cfg.output.dir) / end).is_dir() else None,
        "best_step": run.trainer.best.step,  # of the lowest held-out loss evaluated after a step
        "best_eval_loss": run.trainer.best.loss,
        "best_checkpoint": _best_checkpoint(cfg, run),
        "stopped_early": fit.stopped_early,
        "stopped_at_step": _last_step(run, fit) if fit.stopped_early else None,
        "adapter_from": cfg.output.adapter_from if run.report.adapted else None,
    }


def _best_checkpoint(cfg: Config, run: _Run) -> str | None:
    best = run.trainer.best.step
    if not cfg.checkpoint.keep_best or best is None:
        return None
    return str(checkpoint.step_dir(Path("checkpoints"), best))


# ---------------------------------------------------------------------------------------------------------------
# What the steps use.


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
        log.warning("received %s: finishing the steps under way, then saving a checkpoint", signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class _Kept:
    """The lines of metrics.jsonl and samples.jsonl a resumed run keeps."""

    metrics: list[str] = dataclasses.field(default_factory=list)
    samples: list[str] = dataclasses.field(default_factory=list)


def _kept_lines(out: Path, step: int, env: DistEnv) -> _Kept:
    """On rank 0, the metrics and samples lines a run resumed at `step` keeps (checked with the other inputs)."""
    kept = _Kept()
    from_rank0(lambda: kept.metrics.extend(read_until(out / "metrics.jsonl", step)), env.is_main)
    from_rank0(lambda: kept.samples.extend(read_until(out / "samples.jsonl", step)), env.is_main)
    return kept


def _open_outputs(cfg: Config, env: DistEnv, out: Path, kept: _Kept, replace: bool, start_step: int,
                  samples: bool) -> MetricsLog:
    """Only now, with every input checked, does the output directory get its run files: under --overwrite
    the previous run's are first moved aside whole. A resumed run keeps the metrics (and samples) of the steps
    it resumes after (the steps past its checkpoint are redone), and continues its trackers' runs."""
    if not env.is_main:
        return MetricsLog(None)
    if replace:
        moved = rundir.move_previous_run(out, keep=_inputs_inside(cfg, out))
        if moved is not None:
            log.info("--overwrite: moved the previous run's files to %s (delete it when no longer needed)", moved)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)  # an old finished marker must not survive
    metrics_file, samples_file = out / "metrics.jsonl", out / "samples.jsonl"
    _write_lines(metrics_file, kept.metrics)
    if samples or kept.samples:
        _write_lines(samples_file, kept.samples)
    with rundir.writing(out / "config.yaml"):
        rundir.write_atomic(out / "config.yaml", lambda tmp: config_mod.save(cfg, tmp))
    hyperparameters = {**cfg.to_dict(), "output_dir": str(out.resolve())}
    return MetricsLog(metrics_file, samples_file if samples else None,
                      open_trackers(cfg.output.trackers, hyperparameters, out, start_step))


def _write_lines(path: Path, lines: list[str]) -> None:
    with rundir.writing(path):
        rundir.write_atomic(path, lambda tmp: tmp.write_text("".join(line + "\n" for line in lines)))


def _inputs_inside(cfg: Config, out: Path) -> set[str]:
    """The run entries of `out` that hold one of this run's inputs (the demo model it wrote there)."""
    inputs = [Path(p).resolve() for p in (cfg.model.path, cfg.data.path, cfg.data.eval_path) if p]
    return {name for name in rundir.RUN_ENTRIES
            if any(p.is_relative_to((out / name).resolve()) for p in inputs)}


def _write_json_atomic(path: Path, obj: dict) -> None:
    with rundir.writing(path):
        rundir.write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2)))
