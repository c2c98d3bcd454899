"""The training loop: one optimizer step reads top to bottom in `Trainer.step`."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from qshard.attention import use_shared_prompt_attention
from qshard.checkpoint import CheckpointManager
from qshard.config import Config
from qshard.data import IGNORE_INDEX, Example, GlobalBatchSampler, for_epoch, input_tokens
from qshard.host_embedding import HOST_ROWS, with_input_embeddings
from qshard.models import shares_prompt
from qshard.parallel.compile import compile_choice, step_marker
from qshard.parallel.distributed import DistEnv
from qshard.parallel.fsdp import reshard_all
from qshard.parallel.offload import activation_offload, optimizer_device
from qshard.precision import precision
from qshard.train.best import BestLoss
from qshard.train.grad_sum import build_grad_sum
from qshard.train.host_step import build_update
from qshard.train.loss import TokenObjective, build_loss, loss_positions
from qshard.train.metrics import MetricsLog, Progress, device_memory_gib, mfu_per_token_rate, peak_memory_gib
from qshard.train.nan_policy import NonFiniteError, build_nan_policy
from qshard.train.optim import build_optimizer, build_scheduler, clip_grad_norm, grad_norm
from qshard.train.preference import PreferenceLoss, finish_metrics
from qshard.train.profiler import profiled
from qshard.train.samples import Samples


class HostCopy:
    """A device tensor's values copied to host memory without waiting for them: `read` waits for that copy only,
    not for work queued on the device after it (on a CPU, the tensor itself)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.ready = None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = t

    def read(self) -> list | float:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class StepClock:
    """When a step began and ended: on the device's timeline (CUDA events) where there is one, else on the host's,
    where `issue` runs the step itself. A step queued while the one before it runs begins on the device when that
    one ends, so either way a step is timed by its own work and the device's idle time inside it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start, self.end = self._mark(), None

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self) -> None:
        self.end = self._mark()

    def seconds(self) -> float:
        if not self.cuda:
            return self.end - self.start
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


@dataclass
class IssuedStep:
    """An optimizer step queued on the device; `totals` (loss sum, stop votes, the objective's metric sums and
    counts, trained units and input tokens, gradient norm, float64) is read when it is finished; `stop_vote`, whether
    any rank was asked to stop before the step began, when the host decides whether to queue the next one.
    `skipped`: its update was left out (train.nan_policy: skip_step). The loss scale and peak memory are the step's
    own, read when it was queued (the next step may be queued before it is finished)."""

    step: int
    clock: StepClock
    totals: HostCopy
    stop_vote: HostCopy | None  # taken where `fit` may queue steps (Trainer.pipelined)
    lr: float
    loss_scale: float
    peak_mem_gib: float | None
    skipped: bool = False


@dataclass
class StepInputs:
    """A global batch's micro-batches on the device, the scale that turns their summed losses into the mean
    per trained unit (token, or a preference objective's pair), and the (trained units, input tokens) counts
    summed over ranks (float64, on the device)."""

    batches: list[dict[str, torch.Tensor]]
    scale: torch.Tensor
    counts: torch.Tensor


@dataclass
class FitResult:
    first: EvalResult | None
    last: EvalResult | None
    records: list[dict]
    preempted: bool = False
    stopped_early: bool = False  # train.early_stopping_patience ran out


@dataclass
class EvalResult:
    loss: float
    tokens: int  # the trained units evaluated: tokens, or a preference objective's pairs
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # a preference objective's

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))

    def fields(self) -> dict[str, float]:
        """metrics.jsonl's held-out fields: the loss, and perplexity (sft) or the objective's metrics."""
        if self.metrics:
            return {"eval_loss": self.loss, **{f"eval_{k}": v for k, v in self.metrics.items()}}
        return {"eval_loss": self.loss, "eval_ppl": self.perplexity}

    def describe(self) -> str:
        if self.metrics:
            return f"{self.loss:.4f} (preference accuracy {self.metrics.get('rewards_accuracy', math.nan):.2f})"
        return f"{self.loss:.4f} (perplexity {self.perplexity:.2f})"


class Trainer:
    def __init__(
        self,
        cfg: Config,
        env: DistEnv,
        model: nn.Module,
        train_examples: list[Example],
        eval_examples: list[Example],
        pad_id: int,
    ) -> None:
        self.cfg, self.env, self.model = cfg, env, model
        self.train_examples, self.eval_examples, self.pad_id = train_examples, eval_examples, pad_id
        t = cfg.train
        self.sampler, self.total_steps = self.plan(cfg, len(train_examples), env)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Summed next-token cross-entropy over trained tokens, in fp32 (chunked over the vocabulary's logits
        # where the architecture allows); the step divides by the global batch's trained-token count. Compiled
        # where the blocks are.
        compiled, _ = compile_choice(cfg.parallel, env.device)
        self.loss_sum = build_loss(model, t.loss_chunk_tokens, cfg.parallel.compile_backend if compiled else None)
        # What a micro-batch trains (train.objective): (summed loss, its metrics' sums and counts), with the units
        # the loss is averaged over and how examples are collated.
        # A pair's prompt computed once (pref.share_prompt) where the model's attention allows it.
        shared = shares_prompt(cfg, model.config, model.config._attn_implementation, say=env.is_main)
        if shared:
            use_shared_prompt_attention()
        self.objective = (TokenObjective(self.loss_sum) if t.objective == "sft"
                          else PreferenceLoss(cfg, self.loss_sum, shared))
        # How examples become a micro-batch. Under parallel.cuda_graphs (sft only, config.py) every one is padded to
        # data.max_length: each new width would record the blocks' graphs again (seconds and device memory each).
        # Such rows are right-padded, so under the causal mask no real token sees a padding one: they go without an
        # attention mask (`_prepared`), and every batch reaches the blocks as the same graph inputs.
        self.fixed_width = cfg.parallel.replays_graphs()
        self.collate = self.objective.collate
        if self.fixed_width:
            self.collate = functools.partial(self.objective.collate, width=cfg.data.max_length)
        policy = precision(cfg)
        host_or_gpu = optimizer_device(cfg, env.device)  # where the optimizer steps and the gradients end up
        self.optimizer = build_optimizer(model, cfg.optim, host_or_gpu, policy.loss_scaling, cfg.lora.plus_lr_ratio)
        self.grad_norm = grad_norm(host_or_gpu)
        # Loss scaling for fp16_mixed; in every other mode a pass-through with the same interface.
        self.scaler = policy.grad_scaler(env.device)
        self.nan_policy = build_nan_policy(t.nan_policy, policy.loss_scaling, env.is_main)
        self.activation_offload = activation_offload(cfg, env.device)  # a context factory (or a no-op one)
        # parallel.cuda_graphs: torch's mark that a step (or an evaluation) begins, for its CUDA graph trees. Once a
        # step, not a micro-batch: the gradients the micro-batches add up are a backward graph's outputs, which a
        # mark would let the next replay overwrite.
        self.begin_step = step_marker(cfg.parallel)
        self.scheduler = build_scheduler(self.optimizer, self.total_steps, cfg.optim)
        # The optimizer's step and zero_grad: on this thread, or under parallel.overlap_host_optimizer (cpu_offload)
        # block by block in a host thread that the next forward waits for (train/host_step.py).
        self.update = build_update(cfg, model, self.optimizer, env)
        # How the micro-batches' gradients add up: in backward (FSDP2), or under parallel.defer_grad_accumulation
        # after it, which keeps cpu_offload's copies to the host asynchronous (train/grad_sum.py).
        self.grad_sum = build_grad_sum(cfg, self.params)
        self.progress = Progress(self.total_steps, env.is_main, t.log_every, device_memory_gib(env.device))
        self.mfu_rate = mfu_per_token_rate(model, env.device, env.world_size)  # None: no MFU in the records
        self.stop_requested = False  # set on this rank by the preemption signal handler
        self.stop_agreed = False  # set by the last step: some rank was asked to stop
        self.current_step = 0  # the step `fit` runs (1-based), for the message of a collective that fails in it
        self.checkpoint_meta: dict = {}  # identity fields saved with every checkpoint (set by the run)
        self._prefetched: dict[int, StepInputs] = {}  # the next step's inputs, sent during this step
        self.fit_step = profiled(self._fit_step, cfg, env)  # train.profile_steps, or _fit_step itself
        # `fit` queues a step before waiting for the one before it where nothing is due between them (`_fit_step`).
        # Not while profiling, whose trace of a step should hold that step's work; not with activation offload,
        # whose copies keep the device memory of a step's activations from other use until the device reaches
        # them (a step queued early would hold the next step's too); not under fp16_mixed, whose loss scale is
        # read at the end of each step (a wait for it). The same on every rank.
        self.pipelined = (t.profile_steps is None and not cfg.parallel.offloads_activations()
                          and not policy.loss_scaling)
        self._pending: IssuedStep | None = None  # a step queued, not yet waited for
        self.best = BestLoss(t.early_stopping_patience, t.early_stopping_min_delta)
        self.samples: Samples | None = None  # greedy completions at some steps (set by the run when on)

    @staticmethod
    def plan(cfg: Config, n_examples: int, env: DistEnv) -> tuple[GlobalBatchSampler, int]:
        """This rank's sampler over `n_examples` (which refuses data that does not fill one global batch) and
        the run's optimizer steps: train.max_steps, else train.epochs passes over the data. Known before the
        model is built."""
        t = cfg.train
        sampler = GlobalBatchSampler(n_examples, t.micro_batch_size, t.grad_accum, env.world_size, env.rank, t.seed)
        return sampler, t.max_steps or t.epochs * sampler.steps_per_epoch

    # -----------------------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        """One optimizer step over the global batch `step` (0-based), waited for: its record."""
        return self.finish(self.issue(step))

    def issue(self, step: int) -> IssuedStep:
        """Queue one optimizer step over the global batch `step` (0-based) on the device. Nothing of qshard's
        here waits for the device: each wait would stop the host from queueing work ahead of it (`finish`
        waits once). Some modes wait anyway: fp16's loss scaler reads its overflow flag, CPU offload steps
        the optimizer on the host (parallel.overlap_host_optimizer: block by block under the next forward, see
        train/host_step.py), `train.nan_policy: skip_step` reads whether the loss and gradient norm are
        finite before the update, and transformers inspects the attention mask of a padded batch."""
        self.begin_step()
        clock = StepClock(self.env.device)
        # Whether any rank has been asked to stop before this step began: `fit` reads it before leaving this step
        # queued behind the next, so a preemption saves no later than without queueing, but one step. Only where
        # steps are queued (the same on every rank, so the all-reduce is too).
        stop_vote = None
        if self.pipelined:
            stop_vote = self._on_device(torch.tensor(float(self.stop_requested), dtype=torch.float64))
            dist.all_reduce(stop_vote)
            stop_vote = HostCopy(stop_vote)
        if not self.model.training:  # a walk over every module: only after evaluation
            self.model.train()
        inputs = self._prefetched.pop(step, None) or self._inputs(step)
        batches, scale, counts = inputs.batches, inputs.scale, inputs.counts
        loss_sum = torch.zeros((), device=self.env.device)
        metric_sums = torch.zeros(2 * len(self.objective.metrics), device=self.env.device)
        self.objective.start_step(self.model, batches)
        for batch in batches:
            batch = self._rows_to_device(batch)  # model.embedding_on_host: this micro-batch's rows only
            with self.activation_offload(batch["input_ids"].numel()):
                loss, sums = self.objective(self.model, batch)
            self.update.wait()  # the last step's update (the forward's hooks waited for each block's already)
            self.grad_sum.before_backward()
            self.scaler.scale(loss * scale).backward()
            self.grad_sum.after_backward()
            loss_sum += loss.detach()
            metric_sums += sums

        # Unscaled first, so that the norm and the clipping see the true gradients.
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.params, self.cfg.optim.max_grad_norm, self.grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        skipped = self.nan_policy.skip_update(loss_sum, grad_norm)  # False without a wait unless skip_step
        if not skipped:
            # Skipped (fp16) when any rank's gradients overflowed; update() then lowers the scale for every rank.
            self.update.step(self.scaler)
        self.scaler.update()
        self.scheduler.step()
        self.update.zero_grad()

        # One all-reduce for the logged loss and the preemption vote (a signal may reach only some ranks).
        vote = torch.tensor(float(self.stop_requested), dtype=torch.float64)
        totals = torch.cat([torch.stack([loss_sum.to(torch.float64), self._on_device(vote)]),
                            metric_sums.to(torch.float64)])
        dist.all_reduce(totals)
        # The norm lives where the gradients do: on the host under parallel.cpu_offload.
        norm = grad_norm.detach().to(self.env.device, torch.float64).reshape(1)
        # The next step's batches, prepared and sent while the device runs this one: otherwise the device
        # would idle at the start of every step while the host collates and copies them.
        if step + 1 < self.total_steps:
            self._prefetched = {step + 1: self._inputs(step + 1)}
        issued = IssuedStep(step, clock, HostCopy(torch.cat([totals, counts, norm])), stop_vote, lr,
                            self.scaler.get_scale(), peak_memory_gib(self.env.device), skipped)
        clock.stop()
        return issued

    def _inputs(self, step: int) -> StepInputs:
        """The micro-batches of global batch `step` on the device, and the loss scale that normalizes them."""
        examples = for_epoch(self.train_examples, self.sampler.epoch_of(step))  # packed anew each epoch
        host = [self._collate(idx, examples) for idx in self.sampler.microbatches(step)]
        # Normalize by the trained tokens of the whole global batch, all ranks and micro-batches, so the
        # gradient is the per-token mean however the batch is split. FSDP2 averages gradients over ranks;
        # multiplying by the world size turns that average back into the sum we want. Counted on the host,
        # summed over ranks on the device, and used there: reading the sum back would wait for the device.
        counts = self._all_sum([sum(self.objective.units(b) for b in host), sum(input_tokens(b) for b in host)])
        scale = (self.env.world_size / counts[0].clamp(min=1)).float()
        return StepInputs([self._prepared(b) for b in host], scale, counts)

    def finish(self, issued: IssuedStep) -> dict:
        """Wait for an issued step and return its record. A loss or gradient norm that is not finite is
        judged here (train.nan_policy), from the totals the step reads anyway, before any use of the record."""
        loss_total, votes, *metric_sums, n_trained, n_input, grad_norm = issued.totals.read()  # the one wait
        elapsed = issued.clock.seconds()
        n_trained, n_input = int(n_trained), int(n_input)
        loss = loss_total / max(n_trained, 1)
        skipped = self.nan_policy.judge(issued.step + 1, loss, grad_norm, issued.skipped)
        self.stop_agreed = votes > 0
        record = {
            "step": issued.step + 1,
            "epoch": issued.step // self.sampler.steps_per_epoch,
            "loss": loss,
            "lr": issued.lr,
            "grad_norm": grad_norm,
            "skipped": skipped,  # no update was applied: the loss or gradients were not finite (or fp16 overflowed)
            "tokens": n_input,
            self.objective.unit: n_trained,
            "tokens_per_s": n_input / elapsed,
            "step_time_s": elapsed,
            "peak_mem_gib": issued.peak_mem_gib,
            "loss_scale": issued.loss_scale,  # 1.0 unless fp16_mixed
        }
        if self.mfu_rate is not None:
            record["mfu"] = record["tokens_per_s"] * self.mfu_rate
        if self.objective.metrics:
            record.update(finish_metrics(self.objective.metrics, metric_sums))
        return record

    # -----------------------------------------------------------------------------------------------------------
    def fit(
        self,
        metrics: MetricsLog,
        start_step: int = 0,
        checkpoints: CheckpointManager | None = None,
        first: EvalResult | None = None,
    ) -> FitResult:
        """Train from `start_step` to `total_steps` (evaluating every `eval_every` and at the end), saving
        checkpoints as configured. Stops early, after saving, when a preemption signal arrived.
        Without a held-out set (data.eval_fraction 0 and no eval file) there is nothing to evaluate."""
        if first is None and self.eval_examples:
            first = self.evaluate()
            self.nan_policy.check_eval("before training", first.loss)
            self.progress.message(f"held-out loss before training: {first.describe()}")
        self.progress.start(start_step)
        # Resumed from the checkpoint early stopping saved (and the same patience): nothing is left to train.
        result = FitResult(first=first, last=first, records=[], stopped_early=self.best.exhausted)
        try:
            for step in range(start_step, self.total_steps):
                if result.preempted or result.stopped_early:
                    break
                self.fit_step(step, metrics, checkpoints, result)
            self.update.wait()  # the weights are read next (export, evaluation): the last update must be in them
        except NonFiniteError:
            # Every rank stops at the same step (what is judged was summed over ranks): the checkpoint of an
            # earlier step, still being written in the background, is completed rather than left unfinished.
            if checkpoints is not None:
                checkpoints.wait()
            raise
        finally:
            self.progress.close()
        return result

    def _fit_step(self, step: int, metrics: MetricsLog, checkpoints: CheckpointManager | None,
                  result: FitResult) -> None:
        """One step of `fit`: queue it, then wait for the step queued before it, if any, and record that; then, if
        something is due once this step is done (evaluation, samples, a checkpoint, the run's end), some rank was
        asked to stop or a background save is being written (its poll waits for the device), wait for it and do
        that. Otherwise it stays queued while the host queues the next step, and the device goes from one step to
        the next without waiting for the host to read a loss. Every input to that choice is the same on every rank,
        so every rank runs its collectives (a background save's poll among them) in the same order."""
        self.current_step = step + 1
        # Dropout's randomness is a function of the step, so a resumed run draws what it would have.
        torch.manual_seed(hash((self.cfg.train.seed, step, self.env.rank)) & 0x7FFF_FFFF)
        issued = self.issue(step)
        if self._pending is not None:  # nothing is due after it; a stop it reports is saved after `issued`
            pending, self._pending = self._pending, None
            self._complete(pending, metrics, checkpoints, result, save=False)
        if (self.pipelined and not self._due_after(step + 1) and not result.preempted
                and (checkpoints is None or checkpoints.pending is None) and not issued.stop_vote.read()):
            self._pending = issued
            return
        self._complete(issued, metrics, checkpoints, result)

    def _due_after(self, done: int) -> bool:
        """Whether anything but the record is due once `done` steps are done, with that step's weights alone: the
        run's end, an evaluation (and with it early stopping and the best checkpoint), samples, a periodic save."""
        return (done == self.total_steps or self._eval_due(done) or self._samples_due(done)
                or self._save_due(done))

    def _eval_due(self, done: int) -> bool:
        every = self.cfg.train.eval_every
        return bool(self.eval_examples) and (bool(every and done % every == 0) or done == self.total_steps)

    def _samples_due(self, done: int) -> bool:
        return self.samples is not None and self.samples.due(done, self.total_steps)

    def _save_due(self, done: int) -> bool:
        every = self.cfg.checkpoint.every_steps
        return bool(every and done % every == 0) or (done == self.total_steps and self.cfg.checkpoint.at_end)

    def _complete(self, issued: IssuedStep, metrics: MetricsLog, checkpoints: CheckpointManager | None,
                  result: FitResult, save: bool = True) -> None:
        """Wait for a queued step and do what follows it: evaluation when due, samples, its metrics line, a save
        when due (`save`: not for a step with another queued behind it, after which nothing is due). A step whose
        loss is not finite raises here (train.nan_policy: error)."""
        record = self.finish(issued)
        if self._eval_due(record["step"]):
            result.last = self.evaluate()
            self.nan_policy.check_eval(f"after step {record['step']}", result.last.loss)
            record.update(result.last.fields())
            self._judge_eval(record["step"], result)
        if self._samples_due(record["step"]):
            self.update.wait()
            metrics.samples(record["step"], self.samples.generate(self.model, self.env.device))
        metrics.write(record)
        self.progress.step(record)
        result.records.append(record)
        result.preempted = self.stop_agreed
        if checkpoints is not None:
            checkpoints.poll()
            if save:
                self._maybe_save(checkpoints, record["step"], result)

    def _judge_eval(self, done: int, result: FitResult) -> None:
        """Record the held-out loss after step `done` and decide whether to stop early. Every rank decides
        alike: the loss was summed over ranks by one all-reduce, whose result every rank holds bit for bit."""
        self.best.update(done, result.last.loss)
        result.stopped_early = self.best.exhausted and done < self.total_steps
        if result.stopped_early:
            self.progress.message(
                f"early stopping at step {done}: {self.best.evals_without_improvement} evaluations without a "
                f"held-out loss below {self.best.loss:.4f} (step {self.best.step}) by more than {self.best.min_delta}"
            )

    def _maybe_save(self, checkpoints: CheckpointManager, done: int, result: FitResult) -> None:
        final = (done == self.total_steps and self.cfg.checkpoint.at_end) or result.preempted or result.stopped_early
        # checkpoint.keep_best: a new best is saved now, and no pruning removes it while it is the best.
        new_best = self.cfg.checkpoint.keep_best and self.best.step == done
        checkpoints.keep_step = self.best.step if self.cfg.checkpoint.keep_best else None
        if final or new_best or self._save_due(done):
            meta = {**self.checkpoint_meta, "step": done, "scheduler": self.scheduler.state_dict(),
                    "grad_scaler": self.scaler.state_dict(),  # {} unless fp16_mixed
                    "eval_loss_start": result.first.loss if result.first else None,
                    "best": self.best.state(), "stopped_early": result.stopped_early}
            self.update.wait()  # the checkpoint holds this step's update
            # The last save (or one forced by preemption) must be on disk before the process exits.
            checkpoints.save(done, self.model, self.optimizer, meta, blocking=final)

    def restore(self, state: dict) -> None:
        """The schedule's and the loss scaler's state from a checkpoint's trainer_state.json. A checkpoint
        saved in another precision mode has no scaler state: fp16 then starts from the initial scale."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.best.restore(state.get("best"))
        if self.scaler.is_enabled() and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])

    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        """Mean loss per trained unit (token, or pair) over the held-out set, with the objective's metrics.
        Ranks take interleaved examples; every rank runs the same number of forwards (FSDP2 all-gathers are
        collective): a token objective pads with zero-weight repeats, a preference one leaves padding out, and
        a rank left with none at the end runs a real example at weight 0."""
        self.update.wait()
        self.begin_step()
        self.model.eval()
        n, world, mbs = len(self.eval_examples), self.env.world_size, self.cfg.train.micro_batch_size
        per_rank = math.ceil(n / world)
        mine = [i * world + self.env.rank for i in range(per_rank)]
        sums = torch.zeros(1 + 2 * len(self.objective.metrics), device=self.env.device)
        units = 0
        for start in range(0, per_rank, mbs):
            chunk = mine[start : start + mbs]
            real = [i for i in chunk if i < n]
            batch = self._eval_batch(real, mbs if self.fixed_width else len(chunk))  # one shape under fixed_width
            units += self.objective.units(batch) if real else 0
            loss, metric_sums = self.objective(self.model, self._to_device(batch))
            sums += torch.cat([loss.detach().reshape(1), metric_sums]) * (1.0 if real else 0.0)
        total = self._all_sum_tensor(sums)
        total_units = int(self._all_sum([units]).item())
        # Without a backward to trigger it, modules that keep weights gathered after forward (the last
        # block, the root) would stay unsharded, holding bf16 copies where the fp32 shards belong.
        reshard_all(self.model)
        metrics = finish_metrics(self.objective.metrics, total[1:].tolist()) if self.objective.metrics else {}
        return EvalResult(float(total[0]) / max(total_units, 1), total_units, metrics)

    def _eval_batch(self, real: list[int], size: int) -> dict[str, torch.Tensor]:
        """Held-out examples `real` collated; a token objective's batch padded to `size` with zero-weight repeats."""
        if not isinstance(self.objective, TokenObjective):  # pairs have no tokens to mask: padding is left out
            return self._collate(real or [0], self.eval_examples)
        batch = self._collate(real + [0] * (size - len(real)), self.eval_examples)
        batch["labels"][len(real) :] = IGNORE_INDEX  # padding examples contribute no tokens
        return batch

    # -----------------------------------------------------------------------------------------------------------
    def _collate(self, indices: list[int], examples: list[Example] | None = None) -> dict[str, torch.Tensor]:
        examples = self.train_examples if examples is None else examples
        return self.collate([examples[i] for i in indices], self.pad_id)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A collated batch on the device (`_prepared`, its host embedding rows included)."""
        return self._rows_to_device(self._prepared(batch))

    def _prepared(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A collated batch on the device (but for its host embedding rows), with what the step would otherwise ask
        the device for decided here on the host (every such question waits for the GPU to finish its queue): the
        flat positions the loss is computed at (from the labels as they are now: change them before, not after; a
        batch that names its targets, `loss_targets`, came with its positions), and no attention mask where
        nothing is padded (the causal mask alone is the same, and transformers would check the mask's values on
        the device), nor for rows padded to one width (`fixed_width`: right padding, which no real token sees). Its
        tokens' host embedding rows (model.embedding_on_host) are looked up here and stay in pinned host memory until
        `_rows_to_device`: a step's prepared micro-batches would otherwise hold all of theirs on the GPU."""
        batch = dict(batch)
        if "loss_targets" not in batch:
            batch["loss_positions"] = loss_positions(batch["labels"])
        if "attention_mask" in batch and (self.fixed_width or bool(batch["attention_mask"].all())):
            del batch["attention_mask"]
        batch = with_input_embeddings(self.model, batch)  # model.embedding_on_host: the rows, looked up here
        return {k: self._pinned(v) if k == HOST_ROWS else self._on_device(v) for k, v in batch.items()}

    def _rows_to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The prepared batch with its host embedding rows copied to the device, just before its forward (from
        pinned memory, without waiting); the copy is freed with the batch, after its backward."""
        if HOST_ROWS not in batch:
            return batch
        return {**batch, HOST_ROWS: batch[HOST_ROWS].to(self.env.device, non_blocking=True)}

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.env.device.type == "cuda" else t

    def _on_device(self, t: torch.Tensor | tuple) -> torch.Tensor | tuple:
        if isinstance(t, tuple):  # a shared preference batch's rows: tensors in tuples
            return tuple(self._on_device(x) for x in t)
        if self.env.device.type == "cuda":
            # From pinned memory the copy does not wait for the device's queue; from pageable memory it does.
            return t.pin_memory().to(self.env.device, non_blocking=True)
        return t.to(self.env.device)

    def _all_sum(self, values: list[int]) -> torch.Tensor:
        """The sums over ranks, as float64 on the device (exact below 2**53), not waited for."""
        t = self._on_device(torch.tensor(values, dtype=torch.float64))
        dist.all_reduce(t)
        return t

    def _all_sum_tensor(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, float64, on the host."""
        t = value.detach().to(torch.float64)
        dist.all_reduce(t)
        return t.cpu()
