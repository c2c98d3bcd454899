"""The one configuration tree: dataclasses, loaded from YAML, overridden from the command line, validated
up front (before any weight or example is read), and saved beside every run as ``config.yaml``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from qshard.errors import QShardError
from qshard.versions import versions

log = logging.getLogger("qshard")

TrainType = Literal["qlora", "lora", "full", "llama_pro", "dora", "qdora"]
# Train types whose frozen block linears are quantized (quant.method), those whose adapters are DoRA, and
# those that train weights of the model itself rather than adapters.
QUANTIZED_TRAIN_TYPES = ("qlora", "qdora")
DORA_TRAIN_TYPES = ("dora", "qdora")
ADAPTERLESS_TRAIN_TYPES = ("full", "llama_pro")
Schedule = Literal["constant", "linear", "cosine"]
DataFormat = Literal["auto", "instruction", "chat", "sharegpt", "text"]
Precision = Literal["fp32", "bf16", "bf16_mixed", "fp16_mixed"]
Sharding = Literal["full", "grad_op", "none", "hybrid"]
Objective = Literal["sft", "dpo", "ipo", "orpo", "simpo", "kto"]
# Objectives that compare policy log-probs with a reference model's (the base with its adapters switched off).
REFERENCE_OBJECTIVES = ("dpo", "ipo", "kto")
# Objectives whose every example is two rows of one forward, chosen and rejected (data/preference.py); KTO's is one.
PAIR_OBJECTIVES = ("dpo", "ipo", "orpo", "simpo")
# The longest collective timeout accepted (a year): far beyond any wait that could end well.
MAX_TIMEOUT_S = 365 * 24 * 3600.0


@dataclass
class ModelConfig:
    # Local Hugging Face model directory, or a Hub id (org/name, org/name@revision) resolved through the Hub
    # cache (loading/hub.py); empty means the embedded demo model.
    path: str | None = None
    # Class name of the transformer block; default: the model's `_no_split_modules`.
    block_class: str | None = None
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    # Where the frozen weights come from: the checkpoint in `path`, or random values (benchmarks, shapes
    # with no checkpoint), generated and quantized tensor by tensor.
    init: Literal["checkpoint", "random"] = "checkpoint"
    # A named shape (llama3-8b, llama3-70b, ...) instead of `path`'s config.json; implies init: random.
    shape: str | None = None
    # each_rank: every process reads the files; broadcast: rank 0 reads each tensor and sends it to
    # the others (only rank 0's node needs the weight files).
    load_mode: Literal["each_rank", "broadcast"] = "each_rank"
    # The Hub id's revision (branch, tag or commit) when model.path is a Hub id; empty: its default branch.
    revision: str | None = None
    # Look the input embedding up on the host, from a host copy of its weight, instead of keeping it on the GPU
    # (host_embedding.py): LoRA/QLoRA/DoRA with an untied, frozen embedding only. auto: on where one process trains
    # on one GPU, without parallel.cpu_offload or parallel.activation_offload, and the embedding can be looked up
    # there (host_embedding.py, embedding_on_host_choice); off elsewhere (and in code that builds a model without
    # that decision).
    embedding_on_host: Literal["auto", True, False] = "auto"

    def looks_up_on_host(self) -> bool:
        """Whether the input embedding is looked up on the host (embedding_on_host): `auto` not yet settled reads
        as off."""
        return self.embedding_on_host is True


# lora.init: peft's init_lora_weights names; pissa_niter_N for the iteration counts in use (peft's docs use 4 and 16).
LORA_INITS = ("default", "pissa", "olora", *(f"pissa_niter_{n}" for n in (1, 2, 4, 8, 16)))


@dataclass
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # Leaf names of the block linears to adapt (e.g. [q_proj, v_proj]); empty means every linear in the blocks.
    target_modules: list[str] | None = None
    # Scale the adapter by alpha / sqrt(rank) (rank-stabilized LoRA) instead of alpha / rank.
    use_rslora: bool = False
    # LoRA+: the B factors (and DoRA's magnitudes) train at optim.lr times this (16 is typical); empty: at optim.lr.
    plus_lr_ratio: float | None = None
    # How A and B start, by peft's names: default (A random, B zero), or from the base weight, which keeps the
    # residual (on a quantized base, the residual is what gets quantized): pissa (top-r singular directions; by a
    # full SVD, or pissa_niter_N: a randomized one with N subspace iterations, far faster) or olora (QR).
    init: Literal[LORA_INITS] = "default"
    # Modules outside the blocks trained in full beside the adapters, by leaf name as PEFT takes them (e.g.
    # [embed_tokens, lm_head]: what new tokens need); stored in the master dtype, with their AdamW state.
    modules_to_save: list[str] | None = None


# The quantization methods by quant.method name, and the quant.bits each takes: a torch-free copy of what
# their layers declare (qshard.quant.QUANT_METHODS, which adds the methods registered later here too), so
# that a config is checked before torch is imported.
QUANT_BITS: dict[str, tuple[int, ...]] = {"nf4": (4,), "hqq": (4, 3, 2)}


def _quant_bits_values() -> tuple[int, ...]:
    return tuple(sorted({bits for values in QUANT_BITS.values() for bits in values}, reverse=True))


@dataclass
class QuantConfig:
    # How qlora / qdora store the frozen block linears: NF4 (bitsandbytes' 4-bit NormalFloat), HQQ, or a method
    # registered since. These two types are evaluated when read (annotations are strings here), as from_dict
    # reads them, so they take in the methods of QUANT_BITS at that time.
    method: Literal[tuple(QUANT_BITS)] = "nf4"
    # Bits per weight code: NF4 is 4-bit only; HQQ takes 4, 3 or 2.
    bits: Literal[_quant_bits_values()] = 4
    # How many consecutive weights of a row share one scale (NF4's absmax; HQQ's scale and zero).
    blocksize: Literal[64, 128, 256] = 64
    # NF4 only: each block's absmax kept as one byte under its row's largest (double quantization): 4.13 instead
    # of 4.5 bits per weight at blocksize 64 and 4,096 inputs, 8% less memory and host-to-GPU traffic for the base.
    # auto: on for an NF4 base (qlora, qdora), off otherwise; a resumed run keeps its checkpoint's.
    double_quant: Literal["auto", True, False] = "auto"

    def double_quantized(self) -> bool:
        """Whether an NF4 base built with these options keeps its block scales in a byte (auto: yes)."""
        return self.method == "nf4" and self.double_quant is not False


@dataclass
class ColumnsConfig:
    # The record field that holds each standard field, where a dataset names it differently.
    instruction: str | None = None
    input: str | None = None
    output: str | None = None
    messages: str | None = None
    conversations: str | None = None
    text: str | None = None


@dataclass
class SourceConfig:
    # Data file or directory of them (.jsonl, .json, .parquet, .csv, .arrow, a `save_to_disk` directory).
    path: str | None = None
    # Or a Hugging Face Hub dataset name (needs the `datasets` package and, unless cached, the network).
    hub: str | None = None
    # Split of a hub dataset or of a saved DatasetDict directory; empty means train.
    split: str | None = None
    # The hub dataset's configuration (subset) name, and its revision (branch, tag or commit).
    subset: str | None = None
    revision: str | None = None
    # Each example is used `weight` times per epoch (2: twice; 0.5: a seeded half).
    weight: float = 1.0
    format: DataFormat = "auto"
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)


@dataclass
class DataConfig:
    # Data file or directory of training examples; empty (and no `sources`) means the embedded demo dataset.
    path: str | None = None
    # More training sources, mixed with weights: [{path or hub, weight, format, columns, split, ...}].
    sources: list[SourceConfig] | None = None
    # Held-out data file or directory; if empty, `eval_fraction` of each source is held out.
    eval_path: str | None = None
    eval_fraction: float = 0.05
    format: DataFormat = "auto"
    max_length: int = 512
    # Chat template: the tokenizer's (auto falls back to alpaca when it has none) or a built-in one.
    chat_template: Literal["auto", "tokenizer", "alpaca", "chatml"] = "auto"
    # Which tokens the loss trains on: assistant turns (and instruction outputs) only, or all of them.
    train_on: Literal["assistant", "all"] = "assistant"
    # A malformed record stops the run, or is skipped and counted.
    on_bad_record: Literal["error", "skip"] = "error"
    # A record larger than this many MB (10^6 bytes) is a bad record, since tokenizing one takes memory many
    # times its size; 0 or empty: no limit.
    max_record_mb: float | None = 16.0
    # An example longer than max_length is cut to it, or left out (counted either way).
    overlong: Literal["truncate", "drop"] = "truncate"
    # Pack several examples into each sequence of up to max_length tokens (attention kept per example).
    packing: bool = False
    # Where tokenized data is cached; empty means $XDG_CACHE_HOME/qshard/data (~/.cache/qshard/data).
    cache_dir: str | None = None
    # Size cap of the cache in GB: the least recently used entries not in use by a running job go first.
    cache_max_gb: float | None = 20.0
    # Processes that tokenize in parallel (1: in the main process).
    num_workers: int = 1
    # Special tokens added to the tokenizer (those it has already are left alone); the embedding and head grow
    # to the new vocabulary, new rows starting at the mean of the others. Needs them trained
    # (lora.modules_to_save: [embed_tokens, lm_head]).
    add_special_tokens: list[str] | None = None


@dataclass
class OptimConfig:
    lr: float = 2e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # Clip the global gradient norm (over all shards) to this; 0 turns clipping off.
    max_grad_norm: float = 1.0
    schedule: Schedule = "cosine"
    warmup_steps: int = 0
    # The schedule decays to lr * min_lr_ratio.
    min_lr_ratio: float = 0.0


@dataclass
class TrainConfig:
    train_type: TrainType = "qlora"
    # fp32 | bf16 (params and optimizer state in bf16) | bf16_mixed (fp32 master weights and optimizer
    # state, bf16 compute) | fp16_mixed (the same with fp16 compute and loss scaling). Empty: bf16_mixed.
    # See qshard/precision.py.
    precision: Precision | None = None
    seed: int = 42
    # Optimizer steps to run; empty means `epochs` passes over the data.
    max_steps: int | None = None
    epochs: int = 1
    # Examples per rank per forward/backward; global batch = micro_batch_size * grad_accum * world size.
    micro_batch_size: int = 1
    grad_accum: int = 1
    # Evaluate held-out loss every N optimizer steps (and always at the start and end); 0: start and end only.
    eval_every: int = 0
    # Plain log line every N steps when output is not a terminal.
    log_every: int = 1
    # Cross-entropy over this many tokens at a time, so the [tokens, vocab] logits never exist whole
    # (for architectures with a plain output head); 0 computes the full logits. Small enough that one chunk's
    # logits, their fp32 copy and gradient do not set the step's peak memory (docs/configuration.md).
    loss_chunk_tokens: int = 512
    # A step whose loss or gradient norm is NaN or infinite: error ends the run naming the step, before its
    # metrics line or any checkpoint after it; skip_step leaves the weights as they were and goes on.
    nan_policy: Literal["error", "skip_step"] = "error"
    # [a, b]: a torch profiler trace of steps a..b (1-based, inclusive) and, on CUDA, a memory snapshot of the
    # same steps, written by rank 0 into OUTPUT/profile/. Empty: no profiling.
    profile_steps: list[int] | None = None
    # Stop after this many evaluations in a row whose held-out loss is not below the best so far by more than
    # `early_stopping_min_delta` (a final checkpoint, the adapter and summary.json are written as at the end);
    # 0: off. Needs a held-out set and eval_every.
    early_stopping_patience: int = 0
    early_stopping_min_delta: float = 0.0
    # Greedy completions of `sample_prompts` by the model being trained, written to samples.jsonl every N optimizer
    # steps and at the last; empty: with every evaluation (eval_every and the end); 0: no samples.
    sample_every: int | None = None
    # A file (.txt: a prompt per line; .jsonl: {"prompt": ...} or {"messages": [...]}) or a list of prompts;
    # empty: the first 4 held-out examples' prompts (their conversation up to the last assistant turn).
    sample_prompts: str | list[str] | None = None
    # Each sample ends at an end-of-turn token or after this many tokens.
    sample_max_new_tokens: int = 128
    # What the loss trains: sft (next-token cross-entropy), or a preference method on preference data (pref.*):
    # dpo, ipo, kto (against the base with the adapters switched off as reference), orpo, simpo (reference-free).
    objective: Objective = "sft"
    # Continue training this PEFT adapter (a run directory, or its adapter/ directory) instead of new adapters; with
    # a reference objective the reference is the base with this adapter as it starts (precomputed before training).
    init_adapter: str | None = None


@dataclass
class ParallelConfig:
    # Processes to start on this machine through torchrun's launcher (1: run in this process).
    nproc: int = 1
    # Seconds a collective may wait for the other ranks once training has begun; then every rank still
    # waiting stops with an error naming the collective (a stopped or hung rank would hang them forever).
    timeout_s: float = 600.0
    # The same while the model is loaded, where ranks quantize for minutes between collectives.
    load_timeout_s: float = 3600.0
    # Recompute blocks' activations in backward instead of keeping them: every `ac_every`-th block
    # (blocks 0, k, 2k, ...), through torch.utils.checkpoint, reentrant or not.
    activation_checkpointing: bool = True
    ac_every: int = 1
    ac_reentrant: bool = False
    # Compiled blocks checkpointed inside their graph (one device, no LoRA dropout) keep the outputs of their
    # narrowing projections (attention's q/k/v, LoRA's A) and sdpa attention's output and log-sum-exp instead of
    # recomputing them in backward: faster, for more activation memory (docs/configuration.md says how much).
    # auto: on where it takes effect and `qshard train` predicts the run with it well inside the GPU's memory
    # (planner/command.py, preflight), off elsewhere (and in code that builds a model without that prediction).
    ac_save_projections: Literal["auto", True, False] = "auto"
    # Checkpointed blocks keep their attention's output and log-sum-exp from forward to backward, so the recompute
    # does not run attention again (causal attention without a mask or dropout; parallel/kept_attention.py): for
    # long context, where attention is most of a block's forward. Costs tokens x heads x head size in the compute
    # dtype per checkpointed block (1 GiB a block for an 8B model at 128k tokens), held on the GPU.
    ac_keep_attention: bool = False
    # full: params, grads and optimizer state sharded (ZeRO-3); grad_op: the same, but each block keeps its
    # gathered weights from forward to backward (ZeRO-2); none: every rank holds everything (DDP-like);
    # hybrid: replicated across `replicate_degree` groups (nodes), sharded within each.
    sharding: Sharding = "full"
    # hybrid only: how many replicas; 0 means one per node (WORLD_SIZE / LOCAL_WORLD_SIZE).
    replicate_degree: int = 0
    # Keep params, grads and optimizer state on the CPU and step the optimizer there (FSDP2 CPUOffloadPolicy).
    cpu_offload: bool = False
    # cpu_offload: the host AdamW of each block runs in a host thread under the next forward, which waits for a
    # block's update just before copying its weights to the GPU (train/host_step.py); the same numbers.
    overlap_host_optimizer: bool = False
    # cpu_offload with grad_accum > 1: the earlier micro-batches' gradients are added after each backward rather than
    # by FSDP2 inside it, whose copy to the host is then synchronous (train/grad_sum.py); the same numbers, one more
    # set of the trained weights' gradients in host memory.
    defer_grad_accumulation: bool = False
    # Move the activations saved for backward to (pinned) CPU memory during forward, back in backward (a block
    # ahead, on a side stream: parallel/offload.py). auto, settled before the model loads (planner/command.py,
    # activation_offload_choice): on for a CUDA run predicted to fit the GPU only with it, or where it was measured
    # free (one process, sft, micro-batches of 8,192 tokens or more typically, the host's memory to spare); off
    # elsewhere (and in code that builds a model without that decision).
    activation_offload: Literal["auto", True, False] = "auto"
    # Who shards the NF4/HQQ codes and scales: FSDP2 itself (grouped, prefetched all-gathers; as integers, or
    # as bf16/fp32 carriers of the bytes where its FSDP2 refuses integers, checked byte for byte at build
    # time), or DTensor buffers gathered per layer on use (what cpu_offload keeps in host memory a block at a
    # time).
    quant_sharding: Literal["fsdp", "dtensor"] = "fsdp"
    # Compile each transformer block's forward with torch.compile (fewer, fused kernels; the first run of a
    # model pays the compilation, later ones read it from the caches). auto: on where it runs and pays, on CUDA
    # with Triton (parallel/compile.py, compile_choice). The backend is for tests and debugging (aot_eager runs
    # without a C compiler).
    compile: Literal["auto", True, False] = "auto"
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    # Replay each compiled block's kernels as CUDA graphs (inductor's CUDA graph trees): the host launches a
    # block's forward or backward in one call instead of kernel by kernel, and the gaps between kernels close.
    # Only for blocks checkpointed inside their compiled graph (one device, an adapter train type, no LoRA
    # dropout; parallel/compile.py) and train.objective sft. Every micro-batch is padded to data.max_length (a
    # graph is recorded per shape): for rows near that length, or packed. auto: on where it can run and pays,
    # where the training rows fill data.max_length and a micro-batch is short enough that launching its kernels
    # one by one costs a share of the step (parallel/compile.py, cuda_graphs_choice); off elsewhere (and in code
    # that builds a model without that decision).
    cuda_graphs: Literal["auto", True, False] = "auto"
    # Run each block's MLP this many tokens at a time, forward and (recomputing each tile) backward, so that
    # its [tokens, intermediate_size] activations exist for one tile only; 0: the whole sequence at once.
    mlp_tile_tokens: int = 0
    # cpu_offload with quant_sharding dtensor: the quantized storage of the first N blocks stays on the GPU (loaded
    # there, never copied), the rest in host memory: N blocks' storage more GPU memory, that much less host
    # memory and host-to-GPU traffic per step.
    resident_blocks: int = 0

    def saves_projections(self) -> bool:
        """Whether blocks keep their projections (ac_save_projections): `auto` not yet settled reads as off."""
        return self.ac_save_projections is True

    def offloads_activations(self) -> bool:
        """Whether saved activations go to host memory (activation_offload): `auto` not yet settled reads as off."""
        return self.activation_offload is True

    def replays_graphs(self) -> bool:
        """Whether compiled blocks replay as CUDA graphs (cuda_graphs): `auto` not yet settled reads as off."""
        return self.cuda_graphs is True


@dataclass
class CheckpointConfig:
    # Save a resumable checkpoint every N optimizer steps (and always at the end); 0: only at the end.
    every_steps: int = 0
    # Keep only the newest N complete checkpoints.
    keep_last: int = 2
    # Write checkpoints in a background thread while training goes on.
    async_save: bool = True
    # Resume from: none, auto (the newest complete checkpoint in output.dir, or start fresh), or a path.
    resume: str | None = None
    # Also keep the checkpoint of the best held-out loss, beside the newest keep_last (saved at each
    # evaluation that improves it; never pruned). Needs a held-out set and train.eval_every.
    keep_best: bool = False
    # Save a checkpoint when the last step is done. false: only every_steps, keep_best and preemption save
    # (throwaway runs and benchmarks, where a full model's optimizer state would be a large write for nothing).
    at_end: bool = True


@dataclass
class OutputConfig:
    # Where config.yaml, metrics.jsonl, summary.json and adapter/ go; empty means runs/<timestamp>.
    dir: str | None = None
    # Allow writing into a non-empty directory (an earlier run's files there are replaced).
    overwrite: bool = False
    # Where else the metrics, config and samples go, on rank 0: any of tensorboard, wandb, mlflow (each an extra:
    # pip install 'qshard[wandb]'); their local files go to RUN/trackers/.
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(default_factory=list)
    # Which weights adapter/ holds at the end: the last step's, or the best held-out loss's (loaded back from
    # the checkpoint checkpoint.keep_best kept).
    adapter_from: Literal["last", "best"] = "last"


# pref.beta's default per objective: the papers' (SimPO's beta is on length-normalized log-probs, so larger).
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "kto": 0.1, "orpo": 0.1, "simpo": 2.0}


@dataclass
class PrefConfig:
    # The preference objectives' parameters (train.objective); each applies only to the methods named.
    # beta: dpo/kto's inverse temperature on the log-ratio to the reference, ipo's tau, simpo's beta, orpo's
    # reward scale in its logged rewards; empty: the method's default (DEFAULT_BETA).
    beta: float | None = None
    # dpo: conservative DPO's probability that a pair's label is flipped, in [0, 0.5].
    label_smoothing: float = 0.0
    # orpo: the weight of the odds-ratio term beside the chosen answer's mean negative log-likelihood.
    orpo_lambda: float = 0.1
    # simpo: the target reward margin gamma.
    simpo_gamma: float = 0.5
    # Compare per-token mean log-probs instead of summed ones (dpo, ipo); empty: the method's own rule (simpo,
    # orpo and ipo normalize, dpo and kto do not).
    length_normalization: bool | None = None
    # kto: the weights of desirable and undesirable examples' losses (balance them by their counts).
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0
    # Prompt tokens kept (the last ones, after the bos) before the completions are cut to data.max_length;
    # empty: as many as the longest completion leaves, but at least half of data.max_length.
    max_prompt_length: int | None = None
    # Compute the reference log-probs once, before training, and keep them with the tokenized data.
    precompute_reference: bool = False
    # dpo, ipo, orpo, simpo: run each pair as one row, prompt + chosen + rejected, the rejected tokens attending to
    # the prompt and to themselves only, so the prompt is computed once, not twice; empty: on for those objectives
    # where the model's attention allows (sdpa, no sliding-window layers). Set explicitly, kto and sft refuse it.
    share_prompt: bool | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    pref: PrefConfig = field(default_factory=PrefConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def settle_autos(self) -> Config:
        """The `auto` values a run decides from its own options, as it starts (after a checkpoint being resumed
        gave its own: checkpoint.follow_saved_autos), so that its config.yaml and checkpoints say what ran. Until
        then `auto` reads as its choice where it matters (QuantConfig.double_quantized)."""
        q = self.quant
        if q.double_quant == "auto":
            q.double_quant = self.train.train_type in QUANTIZED_TRAIN_TYPES and q.double_quantized()
        return self

    def validate(self) -> Config:
        """Check values that types alone cannot; raise QShardError naming the option."""
        _positive("lora.rank", self.lora.rank)
        _positive("lora.alpha", self.lora.alpha)
        _in_range("lora.dropout", self.lora.dropout, 0.0, 1.0, high_open=True)
        if self.lora.target_modules is not None and not self.lora.target_modules:
            raise QShardError("lora.target_modules: give at least one module name, or leave it empty for all")
        self._validate_lora_variants()
        _positive("data.max_length", self.data.max_length)
        _in_range("data.eval_fraction", self.data.eval_fraction, 0.0, 1.0, high_open=True)
        _positive("data.num_workers", self.data.num_workers)
        if self.data.max_record_mb is not None:
            _non_negative("data.max_record_mb", self.data.max_record_mb)
        if self.data.cache_max_gb is not None:
            _positive("data.cache_max_gb", self.data.cache_max_gb)
        for i, source in enumerate(self.data.sources or []):
            _validate_source(f"data.sources[{i}]", source)
        _positive("optim.lr", self.optim.lr)
        _non_negative("optim.weight_decay", self.optim.weight_decay)
        _in_range("optim.beta1", self.optim.beta1, 0.0, 1.0, high_open=True)
        _in_range("optim.beta2", self.optim.beta2, 0.0, 1.0, high_open=True)
        _positive("optim.eps", self.optim.eps)
        _non_negative("optim.max_grad_norm", self.optim.max_grad_norm)
        _non_negative("optim.warmup_steps", self.optim.warmup_steps)
        _in_range("optim.min_lr_ratio", self.optim.min_lr_ratio, 0.0, 1.0)
        if self.train.max_steps is not None:
            _positive("train.max_steps", self.train.max_steps)
        _positive("train.epochs", self.train.epochs)
        _positive("train.micro_batch_size", self.train.micro_batch_size)
        _positive("train.grad_accum", self.train.grad_accum)
        _non_negative("train.eval_every", self.train.eval_every)
        _positive("train.log_every", self.train.log_every)
        _non_negative("train.loss_chunk_tokens", self.train.loss_chunk_tokens)
        self._validate_profile_steps()
        self._validate_samples()
        _positive("parallel.nproc", self.parallel.nproc)
        for name in ("timeout_s", "load_timeout_s"):
            _positive(f"parallel.{name}", getattr(self.parallel, name))
            _in_range(f"parallel.{name}", getattr(self.parallel, name), 0.0, MAX_TIMEOUT_S)
        self._validate_quant()
        self._validate_parallel()
        _non_negative("checkpoint.every_steps", self.checkpoint.every_steps)
        _positive("checkpoint.keep_last", self.checkpoint.keep_last)
        self._validate_new_tokens()
        self._validate_best()
        self._validate_pref()
        return self

    def _validate_pref(self) -> None:
        """pref.* in range, and set only where train.objective uses it; preference data is not packed."""
        p, objective = self.pref, self.train.objective
        if p.beta is not None:
            _positive("pref.beta", p.beta)
        _in_range("pref.label_smoothing", p.label_smoothing, 0.0, 0.5)
        _non_negative("pref.orpo_lambda", p.orpo_lambda)
        _non_negative("pref.simpo_gamma", p.simpo_gamma)
        _non_negative("pref.kto_desirable_weight", p.kto_desirable_weight)
        _non_negative("pref.kto_undesirable_weight", p.kto_undesirable_weight)
        if p.kto_desirable_weight == 0 and p.kto_undesirable_weight == 0:
            raise QShardError("pref.kto_desirable_weight, pref.kto_undesirable_weight: both 0 leaves no loss")
        if p.max_prompt_length is not None:
            _positive("pref.max_prompt_length", p.max_prompt_length)
            if p.max_prompt_length >= self.data.max_length:
                raise QShardError(f"pref.max_prompt_length must be below data.max_length ({self.data.max_length}), "
                                  f"so that the completions keep a token, got {p.max_prompt_length}")
        own = {"label_smoothing": ("dpo",), "orpo_lambda": ("orpo",), "simpo_gamma": ("simpo",),
               "length_normalization": ("dpo", "ipo"), "kto_desirable_weight": ("kto",),
               "kto_undesirable_weight": ("kto",), "precompute_reference": REFERENCE_OBJECTIVES,
               "share_prompt": PAIR_OBJECTIVES}
        for name, objectives in own.items():
            if getattr(p, name) != getattr(PrefConfig, name) and objective not in objectives:
                raise QShardError(f"pref.{name}: applies to train.objective {' or '.join(objectives)}, "
                                  f"not {objective}")
        if self.train.init_adapter and self.train.train_type in ADAPTERLESS_TRAIN_TYPES:
            raise QShardError(f"train.init_adapter: train.train_type {self.train.train_type} trains no adapters")
        if self.train.init_adapter and self.lora.init != LoRAConfig.init:
            # PiSSA/OLoRA leave the base the residual of the adapter's start; a given adapter is for the original.
            raise QShardError(f"train.init_adapter: continues an adapter of the original base, and lora.init "
                              f"{self.lora.init} trains on a base with its principal part moved into the adapter; "
                              "leave lora.init default")
        if objective == "sft":
            if p.beta is not None or p.max_prompt_length is not None:
                name = "beta" if p.beta is not None else "max_prompt_length"
                raise QShardError(f"pref.{name}: applies to a preference train.objective, not sft")
            return
        if self.data.packing:
            raise QShardError(f"data.packing: train.objective {objective} compares whole sequences; use packing false")
        if self.data.format != "auto" or any(s.format != "auto" for s in self.data.sources or []):
            raise QShardError(f"data.format: train.objective {objective} reads preference records "
                              "({prompt, chosen, rejected} or kto's {prompt, completion, label}); leave it auto")
        renamed = [name for name, c in [("data.columns", getattr(self.data, "columns", None)),
                                        *((f"data.sources[{i}].columns", src.columns)
                                          for i, src in enumerate(self.data.sources or []))]
                   if c is not None and any(dataclasses.astuple(c))]
        if renamed:
            raise QShardError(f"{renamed[0]}: renames SFT fields; preference records are read by their own names "
                              "(prompt, chosen, rejected; kto's prompt, completion, label)")
        if self.train.train_type in ADAPTERLESS_TRAIN_TYPES and objective in REFERENCE_OBJECTIVES:
            raise QShardError(f"train.objective: {objective} takes its reference from the base with the adapters "
                              f"switched off, and train.train_type {self.train.train_type} trains no adapters")
        if objective == "kto" and self.train.micro_batch_size < 2:
            raise QShardError("train.micro_batch_size: train.objective kto estimates its reference point from each "
                              "prompt paired with another example's completion of the same micro-batch, so it needs "
                              f"2 or more, got {self.train.micro_batch_size}")
        if objective == "kto" and p.precompute_reference:
            raise QShardError("pref.precompute_reference: train.objective kto's reference point needs the reference "
                              "of prompts paired with other examples' completions, which change with every batch; "
                              "use false (the reference is then computed each step)")
        if objective == "kto" and self.train.init_adapter:
            raise QShardError("train.init_adapter: train.objective kto would need the reference precomputed with that "
                              "adapter (pref.precompute_reference), which kto's reference point does not allow")
        if self.train.init_adapter and objective in REFERENCE_OBJECTIVES and not p.precompute_reference:
            raise QShardError(f"train.init_adapter: train.objective {objective}'s reference is then the base with that "
                              "adapter as it starts, computed once before training: set pref.precompute_reference true")
        if self.lora.init != LoRAConfig.init and objective in REFERENCE_OBJECTIVES:
            raise QShardError(f"lora.init: train.objective {objective}'s reference is the base with the adapters "
                              f"switched off, which under lora.init {self.lora.init} is the residual of the base, not "
                              "the model; leave lora.init default")
        if self.lora.modules_to_save and objective in REFERENCE_OBJECTIVES:
            raise QShardError(f"lora.modules_to_save: train.objective {objective}'s reference is the base with the "
                              "adapters switched off, which modules trained in full would change")

    def _validate_profile_steps(self) -> None:
        """[a, b] with 1 <= a <= b; that b is within the run is checked once the data gives its step count."""
        steps = self.train.profile_steps
        if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise QShardError(f"train.profile_steps must be [first, last] steps with 1 <= first <= last, got {steps}")
    def _validate_best(self) -> None:
        """Early stopping and the best checkpoint judge held-out losses: a held-out set evaluated during training."""
        t = self.train
        _non_negative("train.early_stopping_patience", t.early_stopping_patience)
        _non_negative("train.early_stopping_min_delta", t.early_stopping_min_delta)
        if t.early_stopping_min_delta and not t.early_stopping_patience:
            raise QShardError("train.early_stopping_min_delta: has no effect without train.early_stopping_patience")
        wanted = [name for name, on in (("train.early_stopping_patience", t.early_stopping_patience > 0),
                                        ("checkpoint.keep_best", self.checkpoint.keep_best),
                                        ("output.adapter_from: best", self.output.adapter_from == "best")) if on]
        if not wanted:
            return
        demo_data = self.data.path is None and not self.data.sources  # the demo brings its held-out file
        if self.data.eval_fraction == 0 and self.data.eval_path is None and not demo_data:
            raise QShardError(f"{wanted[0]}: needs a held-out set (data.eval_path, or data.eval_fraction > 0)")
        if t.eval_every == 0:
            raise QShardError(f"{wanted[0]}: needs train.eval_every > 0 (held-out loss during training)")
        if self.output.adapter_from == "best" and not self.checkpoint.keep_best:
            raise QShardError("output.adapter_from: best needs checkpoint.keep_best: true (the best step's weights "
                              "are read back from its checkpoint)")
        if self.output.adapter_from == "best" and t.train_type in ADAPTERLESS_TRAIN_TYPES:
            raise QShardError(f"output.adapter_from: train.train_type {t.train_type} writes no adapter")
    def _validate_samples(self) -> None:
        t, d = self.train, self.data
        if t.sample_every is not None:
            _non_negative("train.sample_every", t.sample_every)
        _positive("train.sample_max_new_tokens", t.sample_max_new_tokens)
        if t.sample_every and t.sample_prompts is None and not d.eval_path and d.eval_fraction == 0:
            raise QShardError("train.sample_every: nothing to sample: train.sample_prompts is empty and there is no "
                              "held-out set (data.eval_fraction 0 and no data.eval_path)")

    def _validate_lora_variants(self) -> None:
        lora, train_type = self.lora, self.train.train_type
        if lora.plus_lr_ratio is not None:
            _positive("lora.plus_lr_ratio", lora.plus_lr_ratio)
            if train_type in ADAPTERLESS_TRAIN_TYPES:
                raise QShardError(f"lora.plus_lr_ratio: train.train_type {train_type} trains no adapters, so there "
                                  "are no B factors to speed up")
        if lora.use_rslora and train_type in ADAPTERLESS_TRAIN_TYPES:
            raise QShardError(f"lora.use_rslora: scales adapters, which train.train_type {train_type} does not train")
        if lora.init != "default" and train_type in ADAPTERLESS_TRAIN_TYPES:
            raise QShardError(f"lora.init: {lora.init} initializes adapters, which train.train_type {train_type} "
                              "does not train")
        if lora.init != "default" and train_type in DORA_TRAIN_TYPES:
            # peft's PiSSA/OLoRA-to-LoRA conversion, what a shared adapter needs on the original base, keeps A and B
            # only, not DoRA's magnitudes.
            raise QShardError(f"lora.init: {lora.init} with train.train_type {train_type} is not supported (peft "
                              "converts PiSSA/OLoRA adapters for the original base without DoRA's magnitudes); use "
                              f"train.train_type {'qlora' if train_type == 'qdora' else 'lora'}")

    def _validate_new_tokens(self) -> None:
        """What needs no model: modules trained in full beside adapters only, and no empty token. Which modules
        exist, and whether new tokens get a trained embedding and head, is checked on the model (qshard/vocab.py)."""
        train_type = self.train.train_type
        if self.lora.modules_to_save and train_type in ADAPTERLESS_TRAIN_TYPES:
            trains = "every weight" if train_type == "full" else "its new blocks, and exports no adapter"
            raise QShardError(f"lora.modules_to_save: a {train_type} run trains {trains}; it applies to adapter runs "
                              f"({', '.join(t for t in get_args(TrainType) if t not in ADAPTERLESS_TRAIN_TYPES)})")
        if any(not token.strip() for token in self.data.add_special_tokens or []):
            raise QShardError(f"data.add_special_tokens: an empty token in {self.data.add_special_tokens}")
        if self.data.add_special_tokens and train_type == "llama_pro":
            raise QShardError("data.add_special_tokens: a llama_pro run trains only its new blocks, so new tokens' "
                              "embedding and head rows would never train; use train.train_type full, or an adapter "
                              "run with lora.modules_to_save [embed_tokens, lm_head]")

    def _validate_quant(self) -> None:
        """The method's own rules (QUANT_BITS), and a method chosen only where the base is quantized (the
        default method cannot tell chosen from left alone)."""
        q, train_type = self.quant, self.train.train_type
        if q.method not in QUANT_BITS:
            raise QShardError(f"quant.method must be one of {', '.join(QUANT_BITS)}, got {q.method!r}")
        if q.bits not in QUANT_BITS[q.method]:
            raise QShardError(f"quant.bits: {q.method} {_bits_taken(q.method)}, got {q.bits}{_bits_elsewhere(q)}")
        if q.double_quant is True and q.method != "nf4":
            raise QShardError(f"quant.double_quant: compresses NF4's block scales; quant.method {q.method} keeps its "
                              "own, so set quant.method nf4 or quant.double_quant false")
        if q.double_quant is True and train_type not in QUANTIZED_TRAIN_TYPES:
            raise QShardError(f"quant.double_quant: has no effect with train.train_type {train_type}, which keeps "
                              "the base unquantized; use qlora or qdora")
        if q.method != QuantConfig.method and train_type not in QUANTIZED_TRAIN_TYPES:
            raise QShardError(
                f"quant.method: {q.method} quantizes the frozen base, which train.train_type {train_type} keeps "
                f"unquantized; use train.train_type qlora (LoRA) or qdora (DoRA) over an {q.method.upper()} base"
            )

    def _validate_kept_attention(self) -> None:
        """parallel.ac_keep_attention keeps causal attention over whole rows without a mask
        (parallel/kept_attention.py): refused where no attention call of the run would be that, so that it never costs
        its memory for nothing."""
        p = self.parallel
        if not p.activation_checkpointing or p.ac_reentrant:
            raise QShardError("parallel.ac_keep_attention: needs parallel.activation_checkpointing true and "
                              "parallel.ac_reentrant false (it keeps attention through torch's non-reentrant "
                              "checkpoint)")
        if self.model.attn_implementation != "sdpa":
            raise QShardError(f"parallel.ac_keep_attention: keeps sdpa attention only, and model.attn_implementation "
                              f"is {self.model.attn_implementation}")
        if self.data.packing:
            raise QShardError("parallel.ac_keep_attention: packed rows attend through a mask that keeps their "
                              "sequences apart, which it does not keep; use data.packing false, or leave "
                              "ac_keep_attention off")
        if self.train.objective in PAIR_OBJECTIVES:
            raise QShardError(f"parallel.ac_keep_attention: train.objective {self.train.objective} runs each pair as "
                              "one shared row (pref.share_prompt) or as two rows of different lengths with a padding "
                              "mask, neither of which it keeps; leave ac_keep_attention off")

    def _validate_parallel(self) -> None:
        p = self.parallel
        _positive("parallel.ac_every", p.ac_every)
        if not p.activation_checkpointing and (p.ac_reentrant or p.ac_every != 1):
            option = "parallel.ac_reentrant" if p.ac_reentrant else "parallel.ac_every"
            raise QShardError(f"{option}: has no effect with parallel.activation_checkpointing false")
        if p.compile is True and p.ac_reentrant and p.activation_checkpointing:
            # transformers' reentrant checkpointing wraps the block's forward, which compile would then trace:
            # the compiled graphs keep the block activations (docs/benchmarks-history.md).
            raise QShardError(
                "parallel.ac_reentrant: with parallel.compile the checkpoint would be traced into the compiled "
                "graph, which then keeps the activations; use parallel.ac_reentrant false"
            )
        if p.ac_keep_attention:
            self._validate_kept_attention()
        if p.compile is False and p.compile_backend != "inductor":
            raise QShardError(f"parallel.compile_backend: {p.compile_backend} has no effect without parallel.compile")
        if p.ac_save_projections is True:
            # Only blocks whose checkpoint is traced into their compiled graph have projections to keep.
            unmet = checkpoint_trace_unmet(p, self.train.train_type, self.lora.dropout, p.nproc)
            if unmet:
                raise QShardError(f"parallel.ac_save_projections: has no effect without {unmet[0]}")
        if p.cuda_graphs is True:
            unmet = self.cuda_graphs_unmet(p.nproc)
            if unmet:
                raise QShardError(f"parallel.cuda_graphs: {unmet[0]}")
        self._validate_mlp_tiles()
        self._validate_resident_blocks()
        if p.overlap_host_optimizer and not p.cpu_offload:
            raise QShardError("parallel.overlap_host_optimizer: only has an effect with parallel.cpu_offload true "
                              "(the optimizer steps on the host)")
        if p.defer_grad_accumulation and not p.cpu_offload:
            raise QShardError("parallel.defer_grad_accumulation: only has an effect with parallel.cpu_offload true "
                              "(FSDP2 copies gradients to the host only then)")
        _non_negative("parallel.replicate_degree", p.replicate_degree)
        if p.replicate_degree and p.sharding != "hybrid":
            raise QShardError(
                f"parallel.replicate_degree: only hybrid sharding has replicas (parallel.sharding is {p.sharding})"
            )
        if p.sharding == "hybrid" and p.nproc > 1 and p.replicate_degree and p.nproc % p.replicate_degree:
            raise QShardError(
                f"parallel.replicate_degree: {p.replicate_degree} does not divide the {p.nproc} processes "
                "(parallel.nproc) into equal shard groups"
            )

    def cuda_graphs_unmet(self, world_size: int) -> list[str]:
        """Why the compiled blocks of a run of these options on `world_size` processes could not replay as CUDA
        graphs, in order (empty: they can where the blocks compile): the config's refusal of parallel.cuda_graphs
        true, and what keeps `auto` off (parallel/compile.py, cuda_graphs_choice)."""
        p, unmet = self.parallel, []
        if p.compile is False or p.compile_backend != "inductor":
            unmet.append("replays the kernels inductor generates for compiled blocks; needs parallel.compile (true "
                         "or auto) and parallel.compile_backend inductor")
        # A block checkpointed by hooks replays its graph for the recompute while the outputs of the first replay
        # are still in use, which CUDA graph trees refuse (docs/benchmarks-history.md); traced, it has no replay.
        traced = checkpoint_trace_unmet(p, self.train.train_type, self.lora.dropout, world_size)
        if p.ac_reentrant:  # compile auto would not compile (parallel/compile.py, compile_choice)
            traced.insert(0, "parallel.ac_reentrant false")
        if traced:
            unmet.append(f"needs blocks checkpointed inside their compiled graphs, which needs {traced[0]}")
        if self.train.objective != "sft":
            # Pairs come in rows of many widths, each of which would record the blocks' graphs again; sft rows are
            # padded to data.max_length instead (train/loop.py).
            unmet.append(f"for train.objective sft only (not {self.train.objective}): preference pairs come in "
                         "rows of varying width, each recorded as graphs of its own")
        if p.offloads_activations():
            # Its copies to the host read saved tensors on a side stream; in a graph's memory pool those do not own
            # their memory, so a later replay could overwrite one before its copy is done.
            unmet.append("not with parallel.activation_offload (its copies of the saved tensors could race the next "
                         "graph replay)")
        return unmet

    def _validate_resident_blocks(self) -> None:
        p = self.parallel
        _non_negative("parallel.resident_blocks", p.resident_blocks)
        if p.resident_blocks and not (p.cpu_offload and p.quant_sharding == "dtensor"):
            raise QShardError("parallel.resident_blocks: only has an effect with parallel.cpu_offload true and "
                              "parallel.quant_sharding dtensor (the storage in host memory a block at a time)")

    def _validate_mlp_tiles(self) -> None:
        p = self.parallel
        _non_negative("parallel.mlp_tile_tokens", p.mlp_tile_tokens)


def precision_name(cfg: Config) -> str:
    """train.precision; empty means bf16_mixed."""
    return cfg.train.precision or "bf16_mixed"


# ---------------------------------------------------------------------------------------------------------------
# Removed options (one name per option). The config.yaml saved with an earlier run still holds them, mostly
# empty: in a YAML file an empty value is dropped, a set one is read as the option that replaced it where that
# option is left at its default (with a warning), and is otherwise dropped only if it means what the resolved
# options say. Set anywhere else, they are refused with a line that names the replacement.

# train.precision -> the compute dtype, which the removed model.dtype named.
_COMPUTE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "bf16_mixed": "bfloat16", "fp16_mixed": "float16"}


@dataclass(frozen=True)
class _Removed:
    hint: str  # what to write instead
    replacement: str  # the option that replaced it
    default: Any  # that option's default
    values: dict  # a removed value -> the replacement's value that means the same
    meaning: Any  # Config -> the removed option's value that a resolved configuration implies


REMOVED_OPTIONS = {
    "model.dtype": _Removed("use train.precision (fp32 for float32, bf16_mixed for bfloat16)", "train.precision",
                            None, {"float32": "fp32", "bfloat16": "bf16_mixed"},
                            lambda cfg: _COMPUTE_DTYPE[precision_name(cfg)]),
    "parallel.reshard_after_forward": _Removed("use parallel.sharding (grad_op for false)", "parallel.sharding",
                                               "full", {False: "grad_op"},
                                               lambda cfg: cfg.parallel.sharding != "grad_op"),
}
# A removed value of an option -> the value that replaced it (the same behaviour).
REMOVED_VALUES = {("parallel.quant_sharding", "auto"): "fsdp"}


def _removed_option(source: str, dotted: str) -> QShardError:
    return QShardError(f"{source}: {dotted}: removed; {REMOVED_OPTIONS[dotted].hint}")


def _take_removed(tree: dict[str, Any], source: str) -> dict[str, Any]:
    """Take the removed options out of a YAML file's tree. A set one whose replacement the file leaves at its
    default becomes that replacement; the others set are returned, for `_check_removed`. A removed value
    becomes the one that replaced it."""
    found = {}
    for dotted, removed in REMOVED_OPTIONS.items():
        section, name = dotted.split(".")
        node = tree.get(section)
        value = node.pop(name, None) if isinstance(node, dict) else None
        if value is None:
            continue
        new_section, new_name = removed.replacement.split(".")
        replaced = (tree.get(new_section) or {}).get(new_name, removed.default)
        if replaced == removed.default and _hashable(value) and value in removed.values:
            set_dotted(tree, removed.replacement, removed.values[value])
            log.warning("%s: %s is removed; read %s as %s: %s (write that instead)", source, dotted, value,
                        removed.replacement, removed.values[value])
        else:
            found[dotted] = value
    for (dotted, old), new in REMOVED_VALUES.items():
        section, name = dotted.split(".")
        node = tree.get(section)
        if isinstance(node, dict) and node.get(name) == old:
            node[name] = new
    return found


def _hashable(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool))


def _check_removed(found: dict[str, Any], cfg: Config, source: str) -> None:
    """A removed option left in a YAML file beside its replacement is dropped if it means what that says."""
    for dotted, value in found.items():
        now = REMOVED_OPTIONS[dotted].meaning(cfg)
        if type(value) is not type(now) or value != now:
            raise _removed_option(source, dotted)


def _bits_taken(method: str) -> str:
    bits = QUANT_BITS[method]
    return f"is a {bits[0]}-bit format" if len(bits) == 1 else f"takes {_either(bits)} bits"


def _bits_elsewhere(q: QuantConfig) -> str:
    """The methods that take `q.bits`, with the widths they add to q.method's."""
    return "".join(f"; for {_either([b for b in bits if b not in QUANT_BITS[q.method]])} bits use quant.method {name}"
                   for name, bits in QUANT_BITS.items() if q.bits in bits)


def _either(values) -> str:
    values = [str(v) for v in values]
    return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0]


def _validate_source(name: str, source: SourceConfig) -> None:
    if bool(source.path) == bool(source.hub):
        given = "both" if source.path else "neither"
        raise QShardError(f"{name}: give a source either a path or a hub dataset name, not {given}")
    for key in ("subset", "revision"):
        if getattr(source, key) and not source.hub:
            raise QShardError(f"{name}.{key}: only hub datasets have a {key}; this source is the path {source.path}")
    _positive(f"{name}.weight", source.weight)


def checkpoint_trace_unmet(parallel: ParallelConfig, train_type: str, dropout: float, world_size: int) -> list[str]:
    """What keeps the checkpoints of blocks used in place out of their compiled graphs, as option settings, in
    order (empty: traced; parallel/checkpointing.py, traced_checkpoint). The one statement of that rule, for the
    config's validation and for parallel/fsdp.py.

    Why these: a traced checkpoint needs a compiled graph and a checkpoint; it is traced only in blocks used in
    place (one process, storage left to FSDP2, no CPU offload: parallel/fsdp.py, blocks_in_place), which only
    adapter runs have (quantized blocks, or blocks that train only adapters): a quantized block in an FSDP2 unit
    holds float carriers, on which the compiler's partitioner fails; with LoRA dropout a traced checkpoint keeps
    every dropout's output and mask, where the hooks' recomputation redraws them exactly; a tiled MLP breaks the
    block's graph (its tiles run eagerly)."""
    adapter_types = [t for t in get_args(TrainType) if t not in ADAPTERLESS_TRAIN_TYPES]
    return [reason for reason, ok in (
        ("parallel.compile true", parallel.compile is not False),  # auto: decided on the device (compile_choice)
        ("parallel.activation_checkpointing true", parallel.activation_checkpointing),
        (f"an adapter train.train_type ({', '.join(adapter_types)})", train_type in adapter_types),
        ("lora.dropout 0", dropout == 0),
        ("one process (parallel.nproc 1)", world_size == 1),
        ("parallel.cpu_offload false", not parallel.cpu_offload),
        ("parallel.quant_sharding fsdp",
         parallel.quant_sharding != "dtensor" or train_type not in QUANTIZED_TRAIN_TYPES),
        ("parallel.mlp_tile_tokens 0", not parallel.mlp_tile_tokens),
        ("parallel.ac_keep_attention false", not parallel.ac_keep_attention),
    ) if not ok]


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise QShardError(f"{name} must be > 0, got {value}")


def _non_negative(name: str, value: float) -> None:
    if value < 0:
        raise QShardError(f"{name} must be >= 0, got {value}")


def _in_range(name: str, value: float, low: float, high: float, high_open: bool = False) -> None:
    if value < low or value > high or (high_open and value == high):
        bracket = ")" if high_open else "]"
        raise QShardError(f"{name} must be in [{low}, {high}{bracket}, got {value}")


# ---------------------------------------------------------------------------------------------------------------
# Building a Config from dicts: every key checked against the dataclass, every value against its type.


def from_dict(data: dict[str, Any], source: str = "config") -> Config:
    return _build(Config, data, prefix="", source=source)


def _build(cls: type, data: Any, prefix: str, source: str) -> Any:
    if not isinstance(data, dict):
        raise QShardError(f"{source}: {prefix.rstrip('.') or 'top level'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if prefix + key in REMOVED_OPTIONS:
            if value is None:  # as an earlier run's config.yaml holds it
                continue
            raise _removed_option(source, prefix + key)
        if key not in names:
            known = ", ".join(sorted(prefix + n for n in names))
            raise QShardError(f"{source}: unknown option '{prefix}{key}' (known here: {known})")
        kwargs[key] = _coerce(hints[key], value, prefix + key, source)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, name: str, source: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, prefix=name + ".", source=source)
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if isinstance(value, list):  # a list where a string may also be given (train.sample_prompts)
            inner = [a for a in inner if get_origin(a) is list] or inner
        return _coerce(inner[0], value, name, source)
    if origin is Literal:
        # By type as well as value: `64.0 == 64` and `True == 1`, but neither is a valid choice.
        if not any(type(value) is type(a) and value == a for a in args):
            if isinstance(value, str) and (name, value) in REMOVED_VALUES:
                raise QShardError(f"{source}: {name}: {value} is removed; use {REMOVED_VALUES[name, value]} "
                                  "(what it meant)")
            choices = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
            raise QShardError(f"{source}: {name} must be one of {choices}, got {value!r}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise QShardError(f"{source}: {name} must be a list, got {value!r}")
        return [_coerce(args[0], v, name, source) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise QShardError(f"{source}: {name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise QShardError(f"{source}: {name} must be an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, str):  # YAML 1.1 reads `5e-3` (no dot) as a string
            with contextlib.suppress(ValueError):
                number = float(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        # nan passes every `<=` range check below, and inf is no learning rate either.
        if number is None or not math.isfinite(number):
            raise QShardError(f"{source}: {name} must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise QShardError(f"{source}: {name} must be a string, got {value!r}")
    raise AssertionError(f"unhandled config type {tp} for {name}")


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise QShardError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise QShardError(f"{path}: not a YAML text file (invalid UTF-8 at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise QShardError(f"{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    except RecursionError:
        raise QShardError(f"{path}: invalid YAML (nested too deeply to read)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise QShardError(f"{path}: the top level must be a mapping of options")
    return data


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree['a']['b'] = value`` for ``dotted == 'a.b'``, creating mappings on the way."""
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise QShardError(f"option '{dotted}': '{part}' is not a section")
        node = child
    node[leaf] = value


def parse_value(text: str, dotted: str | None = None) -> Any:
    """Command-line values are read as YAML scalars, so `3`, `1e-4`, `true` and `[a, b]` get their types.

    A string option (a path) keeps its text as typed: YAML would turn `--output.dir 2024-06-01` into a
    date and `--output.dir on` into true, and the shell leaves no way to quote them."""
    try:
        value = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        return text
    if value is not None and dotted is not None and _option_type(dotted) is str:
        return text
    return value


def _option_type(dotted: str) -> Any:
    """The type of option `dotted` without its `| None`, or None for an unknown option."""
    tp: Any = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(part)
        if get_origin(tp) in (Union, types.UnionType):
            tp = next(a for a in get_args(tp) if a is not type(None))
    return tp


# The embedded demo (no model and no data given) trains a random tiny model: it needs a larger learning
# rate and batch than a pretrained one. Applied under the user's own settings, never over them. In fp32:
# its matmuls are too small to gain from bf16 on a GPU, and CPUs without native bf16 run bf16 matmuls
# several times slower.
DEMO_PRESET = {
    "train": {"micro_batch_size": 16, "max_steps": 500, "eval_every": 100, "precision": "fp32"},
    "optim": {"lr": 3e-3, "warmup_steps": 10},
    "lora": {"rank": 16, "alpha": 32.0},
    "data": {"max_length": 128},
}


def _merge_under(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge_under(merged[key], value)
        else:
            merged[key] = value
    return merged


def is_demo(tree: dict[str, Any]) -> bool:
    """No model (neither a directory nor a named shape) and no data: the embedded demo. A named shape without
    data trains on the demo's data but is the user's model, so the tiny model's preset is not applied."""
    model, data = tree.get("model") or {}, tree.get("data") or {}
    has_data = isinstance(data, dict) and (data.get("path") or data.get("sources"))
    has_model = isinstance(model, dict) and (model.get("path") or model.get("shape"))
    return not has_model and not has_data


def resolve(yaml_path: str | None, overrides: list[tuple[str, str]]) -> Config:
    """YAML file (if any), then command-line overrides in order, then validation. Removed options in the YAML
    file are taken out first, and checked against the resolved configuration."""
    tree = load_yaml(yaml_path) if yaml_path else {}
    tree.pop(VERSIONS_KEY, None)  # a saved run's record of its libraries, not an option
    removed = _take_removed(tree, str(yaml_path))
    # Each source is checked on its own first, so that an error names where the bad key or value came
    # from (a typo on the command line must not be blamed on the YAML file).
    from_dict(tree, source=str(yaml_path))
    flags: dict[str, Any] = {}
    for dotted, text in overrides:
        set_dotted(flags, dotted, parse_value(text, dotted))
    from_dict(flags, source="command line")
    for dotted, text in overrides:
        set_dotted(tree, dotted, parse_value(text, dotted))
    if is_demo(tree):
        tree = _merge_under(DEMO_PRESET, tree)
    source = yaml_path or "command line"
    cfg = from_dict(tree, source=source)
    _check_removed(removed, cfg, str(yaml_path))
    return cfg.validate()


# The top-level key of a saved config.yaml that records the versions of qshard and its libraries (see
# qshard.versions); `resolve` drops it, so that the file reads back as the options it saved.
VERSIONS_KEY = "versions"


def save(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump({**config.to_dict(), VERSIONS_KEY: versions()}, sort_keys=False))
