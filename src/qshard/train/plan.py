"""The plan of a run, as `qshard train --dry-run` prints it: the model (from the meta-device skeleton, no weight
read), what trains and how, the batch, the data, the steps and epochs, the checkpoint and evaluation cadence, and
where the results go. Computed from the same objects the run itself would build from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from qshard.build import Skeleton
from qshard.config import DORA_TRAIN_TYPES, QUANTIZED_TRAIN_TYPES, Config
from qshard.data import Example
from qshard.data.packing import PackedExamples, example_lengths
from qshard.models import architecture
from qshard.precision import precision


@dataclass
class RunPlan:
    """What a run would do; `lines()` is its text."""

    cfg: Config
    model: Skeleton
    world_size: int
    train: Sequence[Example]
    eval: Sequence[Example]
    steps: int  # the run's optimizer steps
    steps_per_epoch: int
    out: Path
    resume: Path | None = None
    resume_step: int = 0

    def lines(self) -> list[str]:
        rows = [
            ("model", self._model()),
            ("train type", self._train_type()),
            ("trainable", self._trainable()),
            ("precision", self._precision()),
            ("parallel", self._parallel()),
            ("batch", self._batch()),
            ("data", self._data()),
            ("steps", self._steps()),
            ("checkpoints", self._checkpoints()),
            ("evaluation", self._evaluation()),
            ("output", str(self.out)),
        ]
        return ["qshard train --dry-run: every input checked; nothing trained or written"] + [
            f"  {name:<12} {text}" for name, text in rows
        ]

    # ---------------------------------------------------------------------------------------------------------

    def _model(self) -> str:
        model = self.model.model
        name = architecture(model)
        source = self.cfg.model.path or f"model.shape {self.cfg.model.shape}"
        init = ", random weights" if self.cfg.model.init == "random" or self.cfg.model.shape else ""
        host = self.cfg.model.embedding_on_host
        embedding = ("; input embedding looked up on the host" if host is True else
                     "; model.embedding_on_host auto (settled when the run starts)" if host == "auto" else "")
        return (f"{source} ({name}, {len(self.model.blocks)} layers, {self.model.base_params:,} parameters"
                f"{init}){embedding}")

    def _train_type(self) -> str:
        cfg, report = self.cfg, self.model.report
        parts = [cfg.train.train_type]
        if cfg.train.train_type in QUANTIZED_TRAIN_TYPES:
            q = cfg.quant
            kept = f", {len(report.kept)} kept unquantized" if report.kept else ""
            scales = ", double-quantized scales" if q.double_quantized() else ""
            parts.append(f"{q.method.upper()} {q.bits}-bit (blocksize {q.blocksize}{scales}) frozen base on "
                         f"{len(report.quantized)} block modules{kept}")
        if report.adapted:
            kind = "DoRA" if cfg.train.train_type in DORA_TRAIN_TYPES else "LoRA"
            names = sorted({fqn.rsplit(".", 1)[-1] for fqn in report.adapted})
            parts.append(f"{kind} r={cfg.lora.rank} alpha={cfg.lora.alpha:g} dropout={cfg.lora.dropout:g} on "
                         f"{len(report.adapted)} linears ({', '.join(names)}){self._variants()}")
        if cfg.lora.modules_to_save:
            parts.append(f"trained in full: {', '.join(cfg.lora.modules_to_save)}")
        return "; ".join(parts)

    def _variants(self) -> str:
        lora, chosen = self.cfg.lora, []
        if lora.use_rslora:
            chosen.append("rsLoRA")
        if lora.plus_lr_ratio:
            chosen.append(f"LoRA+ x{lora.plus_lr_ratio:g}")
        if lora.init != "default":
            chosen.append(f"init {lora.init}")
        return "".join(f", {name}" for name in chosen)

    def _trainable(self) -> str:
        trainable = sum(p.numel() for p in self.model.model.parameters() if p.requires_grad)
        return f"{trainable:,} parameters ({100 * trainable / max(self.model.base_params, 1):.2f}% of the model's)"

    def _precision(self) -> str:
        p = precision(self.cfg)
        return f"{p.name} (trained weights {_dtype(p.master)}, compute {_dtype(p.compute)})"

    def _parallel(self) -> str:
        p = self.cfg.parallel
        parts = [f"{self.world_size} rank(s), sharding {p.sharding}"]
        if p.sharding == "hybrid":
            parts.append(f"{p.replicate_degree or 'one per node'} replica(s)")
        if self.cfg.train.train_type in QUANTIZED_TRAIN_TYPES:
            parts.append(f"quant_sharding {p.quant_sharding}")
        parts.append(f"activation checkpointing every {p.ac_every} block(s)" if p.activation_checkpointing
                     else "no activation checkpointing")
        flags = [name for name, on in (
            ("compile", p.compile is True), ("compile auto", p.compile == "auto"),
            ("ac_save_projections", p.ac_save_projections is True),
            ("ac_save_projections auto", p.ac_save_projections == "auto"), ("cuda_graphs", p.cuda_graphs is True),
            ("cuda_graphs auto", p.cuda_graphs == "auto"),
            ("cpu_offload", p.cpu_offload), ("activation_offload", p.activation_offload is True),
            ("activation_offload auto", p.activation_offload == "auto")) if on]
        return ", ".join(parts + flags)

    def _batch(self) -> str:
        t = self.cfg.train
        return (f"micro-batch {t.micro_batch_size} x grad-accum {t.grad_accum} x {self.world_size} rank(s) = "
                f"{t.micro_batch_size * t.grad_accum * self.world_size} {self._unit()} per step")

    def _unit(self) -> str:
        if self.cfg.train.objective not in ("sft", "kto"):
            return "pairs"
        return "sequences" if self.cfg.data.packing else "examples"

    def _data(self) -> str:
        d = self.cfg.data
        tokens = int(example_lengths(self.train).sum())
        packed = (f" packed from {len(self.train.examples):,} examples" if isinstance(self.train, PackedExamples)
                  else "")
        return (f"{len(self.train):,} training {self._unit()}{packed} ({tokens:,} tokens), {len(self.eval):,} "
                f"held out; max_length {d.max_length}, packing {'on' if d.packing else 'off'}")

    def _steps(self) -> str:
        epochs = self.steps / self.steps_per_epoch
        text = f"{self.steps:,} optimizer steps ({epochs:.3g} epoch(s) of {self.steps_per_epoch:,} steps)"
        if self.resume is not None:
            text += f"; resumes from {self.resume} at step {self.resume_step}"
        return text

    def _checkpoints(self) -> str:
        c = self.cfg.checkpoint
        every = f"every {c.every_steps} steps and at the end" if c.every_steps else "at the end"
        best = " and the best held-out loss's" if c.keep_best else ""
        return f"{every}, newest {c.keep_last} kept{best}, {'async' if c.async_save else 'blocking'} save"

    def _evaluation(self) -> str:
        if not len(self.eval):
            return "none (no held-out examples)"
        every, patience = self.cfg.train.eval_every, self.cfg.train.early_stopping_patience
        stop = f"; stops early after {patience} evaluations without improvement" if patience else ""
        return f"held-out loss every {every} steps, at the start and at the end{stop}" if every else \
            "held-out loss at the start and at the end"


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")
