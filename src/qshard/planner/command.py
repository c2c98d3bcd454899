"""`qshard plan`: the prediction printed as a table or one JSON object, `--fit`'s search, and the check that
`qshard train` makes before it loads anything (a warning, or with `--auto-fit` the best settings applied)."""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from qshard.build import Skeleton, skeleton, training_tokenizer
from qshard.config import QUANTIZED_TRAIN_TYPES, Config
from qshard.errors import QShardError
from qshard.host_embedding import embedding_on_host_choice
from qshard.parallel.compile import AUTO, compile_choice, cuda_graphs_choice, with_compile_decided
from qshard.parallel.distributed import add_cpu_collectives, from_rank0
from qshard.parallel.fsdp import every_checkpoint_traced
from qshard.planner.estimate import Estimate, estimate
from qshard.planner.fit import Candidate, search
from qshard.planner.hardware import GPUS, Machine, gpu

log = logging.getLogger("qshard")

# An automatic choice spends GPU memory on speed only where the run is predicted to stay this far inside the GPU's
# memory, not just within what `Estimate.fits` allows: a prediction's error must not turn a run that fit into an OOM.
AUTO_SPEND_GPU_FRACTION = 0.8
# And host memory only within this share of the host's: page-locked buffers cannot be swapped out.
AUTO_SPEND_HOST_FRACTION = 0.8
# parallel.activation_offload auto: on from this many tokens a micro-batch. Its hooks' work on the host shows in
# shorter steps, which the host nearly bounds already (8B at 2,048 tokens on an H200: 27% slower); at 8,192 the
# GPU's work hides it and the copies (as fast as without, 7 GiB less GPU memory: docs/benchmarks.md).
OFFLOAD_MIN_TOKENS = 8192
# ... and where the planner's copies outlast the GPU's work by no more than this share of the step (it predicts 1% at
# 8,192 tokens, where none was measured).
OFFLOAD_EXPOSED_FRACTION = 0.05


def plan_model(cfg: Config, world_size: int, model_dir: Path | None = None, vocab_size: int | None = None
               ) -> Skeleton:
    """The run's skeleton on meta for `world_size` ranks; no weight is read (a Hub id: its config and tokenizer
    files only). `vocab_size`: the training tokenizer's length, where the caller has it."""
    if model_dir is None and cfg.model.shape is None:
        if cfg.model.path is None:
            raise QShardError("qshard plan: give the model (--model DIR or Hub id, or --model.shape NAME)")
        model_dir = _model_files(cfg)
    if vocab_size is None and cfg.data.add_special_tokens:
        vocab_size = len(training_tokenizer(cfg, model_dir))
    return skeleton(cfg, model_dir, world_size, torch.device("cpu"), vocab_size)


def _model_files(cfg: Config) -> Path:
    from qshard.loading.hub import hub_model, resolve

    hub = hub_model(cfg.model.path, cfg.model.revision)
    return Path(cfg.model.path) if hub is None else resolve(hub, weights=False)


def run_plan(cfg: Config, machine: Machine, seq: int | None, as_json: bool, fit: bool, top: int) -> int:
    """Print the prediction (and with `fit`, the fastest settings that fit); exit code 0."""
    if cfg.parallel.sharding == "hybrid" and not cfg.parallel.replicate_degree:
        cfg.parallel.replicate_degree = machine.nodes  # one replica per node, as a run finds from its launcher
    length = seq or cfg.data.max_length
    if length <= 0:
        raise QShardError(f"--seq must be > 0, got {length}")
    cfg = compile_planned(cfg, triton=True)
    model = plan_model(cfg, machine.world_size)
    planned, found, settled = copy.deepcopy(cfg), None, []
    # parallel.activation_offload and model.embedding_on_host auto first, as `qshard train` settles them: the
    # settings below are planned with both as the run would have them (--fit's search settles the embedding for each
    # setting it tries, and names the offload in each).
    if cfg.parallel.activation_offload == AUTO:
        planned.parallel.activation_offload, why = activation_offload_choice(model, planned, machine, length)
        settled.append(f"parallel.activation_offload auto: {why}")
    embedding = settle_embedding_on_host(planned, True, machine.world_size, lambda: model)
    settled += [embedding] if embedding else []
    if cfg.parallel.ac_save_projections == AUTO:  # as `qshard train` would settle it on this machine
        planned.parallel.ac_save_projections, why, found = _save_projections(model, planned, machine, length)
        settled.append(f"parallel.ac_save_projections auto: {why}")
    if cfg.parallel.cuda_graphs == AUTO:  # as `qshard train` settles it (after the above) for full rows of `length`
        rows = copy.deepcopy(planned)
        rows.data.max_length = length
        t = cfg.train
        micro_batches = t.max_steps * t.grad_accum if t.max_steps else None  # else the data decides the run's length
        planned.parallel.cuda_graphs, why = cuda_graphs_choice(
            rows, torch.device("cuda"), machine.world_size, lambda: np.array([length]), micro_batches,
            lambda: every_checkpoint_traced(model.model, model.blocks, machine.world_size, cfg), triton=True)
        settled.insert(0, why)
        if planned.parallel.cuda_graphs:
            found = None  # the projections' estimate was of blocks launched without graphs
    found = found or estimate(model, planned, machine, length)
    # The search from the settings as given: a candidate then names ac_save_projections wherever it could take
    # effect, since `qshard train` would settle `auto` again for the candidate's own settings (cuda_graphs auto
    # reads as off there).
    fits = _search(model, cfg, machine, length, top) if fit else None
    if as_json:
        out = {**found.to_json(), "seq": length}
        for key in ("activation_offload", "ac_save_projections", "cuda_graphs"):
            if getattr(cfg.parallel, key) == AUTO:
                out[key] = getattr(planned.parallel, key)
        if embedding:
            out["embedding_on_host"] = planned.model.embedding_on_host
        if fits is not None:
            out["fit"] = [_candidate_json(c) for c in fits[0]]
        print(json.dumps(out))
    else:
        print("\n".join(_table(planned, model, found, length, settled)))
        if fits is not None:
            print("\n".join(_fit_lines(*fits)))
    return 0


def _search(model: Skeleton, cfg: Config, machine: Machine, seq: int, top: int, model_dir: Path | None = None,
            vocab_size: int | None = None, offer_double_quant: bool = True) -> tuple[list[Candidate], Candidate]:
    """`search`; where nothing searched fits over an NF4 base with fp32 scales (`quant.double_quant false`), and
    `offer_double_quant`, the same search with quant.double_quant (an 8% smaller base, in GPU or host memory) and,
    if any of it fits, those settings instead, the option among their flags."""
    fitting, smallest = search(model, cfg, machine, seq, top)
    q = cfg.quant
    if (fitting or not offer_double_quant or q.double_quantized() or q.method != "nf4"
            or cfg.train.train_type not in QUANTIZED_TRAIN_TYPES):
        return fitting, smallest
    compressed = copy.deepcopy(cfg)
    compressed.quant.double_quant = True
    compressed = compressed.validate()
    found, _ = search(plan_model(compressed, machine.world_size, model_dir, vocab_size), compressed, machine, seq, top)
    return [Candidate([("quant.double_quant", "true"), *c.overrides], c.estimate) for c in found], smallest


def _candidate_json(c: Candidate) -> dict:
    return {"overrides": [f"--{k} {v}" for k, v in c.overrides], "tok_s": round(c.estimate.tok_s, 1),
            "peak_gpu_gib": round(c.estimate.peak_gpu_gib, 3), "peak_host_gib": round(c.estimate.peak_host_gib, 3)}


def _table(cfg: Config, model: Skeleton, e: Estimate, seq: int, settled: list[str] | None = None) -> list[str]:
    """`settled`: the lines saying how `auto` settings were settled for this machine."""
    m, t = e.machine, cfg.train
    source = cfg.model.path or f"model.shape {cfg.model.shape}"
    lines = [
        f"qshard plan: {source} ({len(model.blocks)} blocks, {model.base_params:,} parameters), {t.train_type}, "
        f"{m.nodes} node(s) x {m.gpus_per_node} {m.gpu.name} ({m.gpu.memory_gib:g} GiB)",
        f"  batch: seq {seq} x micro-batch {t.micro_batch_size} x grad-accum {t.grad_accum} x {m.world_size} rank(s) "
        f"= {e.tokens_per_step:,} tokens per step",
        *[f"  {line}" for line in settled or []],
        "",
        f"  {'GPU memory, the largest rank':<40}{'GiB':>9}",
    ]
    lines += [f"    {name:<38}{value:>9.2f}" for name, value in e.parts.items() if value >= 0.005]
    verdict = "fits" if e.fits_gpu else "DOES NOT FIT"
    lines.append(f"    {'peak':<38}{e.peak_gpu_gib:>9.2f}  of {m.gpu.memory_gib:g} ({e.usable_gpu_gib:.1f} usable): "
                 f"{verdict}")
    if len(set(round(x, 2) for x in e.peak_gpu_gib_per_rank)) > 1:
        lines.append(f"    per rank: {', '.join(f'{x:.2f}' for x in e.peak_gpu_gib_per_rank)}")
    lines += ["", f"  {'host memory, per node':<40}{'GiB':>9}"]
    lines += [f"    {name:<38}{value:>9.2f}" for name, value in e.host_parts.items() if value >= 0.005]
    limit = f"of {m.host_mem_gib:g}: {'fits' if e.fits_host else 'DOES NOT FIT'}" if m.host_mem_gib else \
        "(--host-mem not given: not checked)"
    peak = f"peak (loading {e.loading_host_gib:.1f})"
    lines.append(f"    {peak:<38}{e.peak_host_gib:>9.2f}  {limit}")
    lines += ["", f"  {'step time':<40}{'s':>9}"]
    lines += [f"    {name:<38}{value:>9.3f}" for name, value in e.time_parts.items() if value >= 0.0005]
    lines.append(f"    {'step':<38}{e.step_s:>9.3f}  {e.tok_s:,.0f} tok/s")
    lines += [f"  note: {note}" for note in e.notes]
    lines += ["", f"fits: {'yes' if e.fits else 'no'}"]
    return lines


def _fit_lines(fitting: list[Candidate], smallest: Candidate) -> list[str]:
    if not fitting:
        return ["", f"--fit: no setting searched is predicted to fit; the smallest peak is "
                f"{smallest.estimate.peak_gpu_gib:.2f} GiB per GPU with {smallest.flags()} (fewer tokens per "
                "micro-batch, more GPUs, or a smaller lora.rank would help)"]
    lines = ["", "--fit: the fastest settings predicted to fit (add them to the command line):"]
    for c in fitting:
        lines.append(f"  {c.estimate.tok_s:>9,.0f} tok/s  {c.estimate.peak_gpu_gib:6.2f} GiB  {c.flags()}")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Before `qshard train` loads anything.


def this_machine(device: torch.device, world_size: int) -> Machine | None:
    """The machine a run is on, where its GPU memory is known (CUDA); None elsewhere. The GPU's memory is what this
    process may allocate: under a cap (torch.cuda.set_per_process_memory_fraction) that share of it."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    memory = props.total_memory * torch.cuda.get_per_process_memory_fraction(device)
    name = props.name.lower().replace(" ", "")
    kind = next((k for k in sorted(GPUS, key=len, reverse=True) if k.replace("-", "") in name), "h100")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Machine(gpu(kind, memory / 2**30), max(1, world_size // local), min(local, world_size), host)


def preflight(cfg: Config, machine: Machine | None, model_dir: Path | None, vocab_size: int, auto_fit: bool,
              is_main: bool, lengths: Callable[[], np.ndarray] | None = None) -> None:
    """Predict the run before it loads, on rank 0 (the others would repeat its work on the same CPUs): warn in
    one line when it is predicted not to fit, or with `auto_fit` apply the fastest settings predicted to fit,
    rank 0's choice on every rank (nodes that differ in host memory could otherwise choose apart), with the CPU
    collectives it needs added to the run's process group. `lengths()`: the training rows' tokens (None: rows of
    data.max_length), asked only where parallel.activation_offload auto needs them."""
    if auto_fit and machine is not None:
        overrides = from_rank0(lambda: _guarded(lambda: _auto_fit(cfg, machine, model_dir, vocab_size)), is_main)
        for dotted, value in overrides or []:
            section, key = dotted.split(".")
            setattr(getattr(cfg, section), key, _typed(getattr(getattr(cfg, section), key), value))
        if cfg.parallel.cpu_offload:  # the gradient norm is reduced on the host
            add_cpu_collectives()
    # The run's skeleton, once the settings are final, built where first asked for and shared (each costs a
    # fraction of a second, a 70B one more).
    planned_model = functools.cache(lambda: plan_model(cfg, machine.world_size if machine else 1, model_dir,
                                                       vocab_size))
    # parallel.activation_offload auto, before the embedding's (which leaves the host's memory to the offload) and
    # the projections' (predicted with the offload as settled): rank 0's choice on every rank, said once.
    if cfg.parallel.activation_offload == AUTO:
        on, why = False, "off (no CUDA device: saved activations live in host memory already)"
        if machine is not None:
            on, why = from_rank0(lambda: _guarded(lambda: activation_offload_choice(
                planned_model(), compile_planned(cfg), machine, cfg.data.max_length,
                _median(lengths) if lengths else None)), is_main) or (
                False, "off (the run could not be predicted)")
        cfg.parallel.activation_offload = on
        if is_main:
            log.info("parallel.activation_offload auto: %s", why)
    # model.embedding_on_host auto, once the settings are final (--auto-fit's search settled it for each it tried),
    # before the run is predicted: every rank alike.
    why = settle_embedding_on_host(cfg, machine is not None, machine.world_size if machine else 1, planned_model)
    if why and is_main:
        log.info(why)
    if machine is None:
        if auto_fit and is_main:
            log.warning("--auto-fit: the device's memory is unknown here (no CUDA); the settings are kept as given")
        return
    # parallel.ac_save_projections auto (--auto-fit sets it wherever it could take effect): settled here, rank 0's
    # choice on every rank, said once; off where the run cannot be predicted.
    settle = cfg.parallel.ac_save_projections == AUTO

    def predict() -> tuple[bool, str] | None:
        model = planned_model()
        planned = compile_planned(cfg)
        found = None
        if settle:
            planned.parallel.ac_save_projections, why, found = _save_projections(model, planned, machine,
                                                                                 cfg.data.max_length)
        if not auto_fit:
            _warn_if_not_fitting(found or estimate(model, planned, machine, cfg.data.max_length), machine)
        return (planned.parallel.ac_save_projections, why) if settle else None

    if settle:
        on, why = from_rank0(lambda: _guarded(predict), is_main) or (False, "off (the run could not be predicted)")
        cfg.parallel.ac_save_projections = on
        if is_main:
            log.info("parallel.ac_save_projections auto: %s", why)
    elif not auto_fit and is_main:
        _guarded(predict)


def settle_embedding_on_host(cfg: Config, on_gpu: bool, world_size: int,
                             skeleton: Callable[[], Skeleton]) -> str | None:
    """model.embedding_on_host auto settled in `cfg` (host_embedding.py, embedding_on_host_choice) for a run of
    `world_size` processes, on GPUs or not, before anything is predicted or built from it; the line that says
    how, or None where it was given. Every rank settles it alike: `skeleton()`, the run's planned model (which the
    planner reads the option from `cfg` for, not from the model), is asked only of one process. A skeleton that
    fails to build leaves it off (the build then says why)."""
    if cfg.model.embedding_on_host != AUTO:
        return None
    try:
        on, why = embedding_on_host_choice(cfg, on_gpu, world_size, lambda: skeleton().model)
    except Exception as exc:  # a prediction's failure must not stop a run (as `_guarded`)
        on, why = False, f"off (the model's skeleton: {type(exc).__name__}: {exc})"
    cfg.model.embedding_on_host = on
    return f"model.embedding_on_host auto: {why}"


def activation_offload_choice(model: Skeleton, cfg: Config, machine: Machine, seq: int,
                              typical_row: float | None = None) -> tuple[bool, str]:
    """(whether `cfg`, compile decided, offloads its saved activations under `auto`, why in a few words), for rows
    of up to `seq` tokens, `typical_row` tokens each typically (None: `seq`). Never beside CUDA graphs, parallel.
    cpu_offload (the host's memory and link serve the weights) or without checkpointing (all a block saves would
    cross the link). On where the run is predicted not to fit the GPU without it and to fit with it; else on where
    it was measured to cost nothing: one process training sft rows, micro-batches of OFFLOAD_MIN_TOKENS or more
    typically, the copies predicted to hide under the GPU's work (within OFFLOAD_EXPOSED_FRACTION of the step) and
    the host's memory to stay within AUTO_SPEND_HOST_FRACTION."""
    p = cfg.parallel
    if p.replays_graphs():
        return False, "off (parallel.cuda_graphs true: the graphs' replays could overwrite what its copies read)"
    if p.cpu_offload:
        return False, "off (parallel.cpu_offload spends the host's memory and link on the weights)"
    if not p.activation_checkpointing:
        return False, "off (parallel.activation_checkpointing false: every block's whole working set would move)"
    trial = copy.deepcopy(cfg)
    trial.parallel.activation_offload = True
    found = estimate(model, trial, machine, seq)
    host = machine.host_mem_gib
    within_host = host is None or found.peak_host_gib <= host * AUTO_SPEND_HOST_FRACTION
    trial.parallel.activation_offload = False
    settle_embedding_on_host(trial, True, machine.world_size, lambda: model)  # where that run would keep it
    if not estimate(model, trial, machine, seq).fits_gpu:
        if found.fits_gpu and within_host:
            return True, "on (predicted to fit the GPU with it, not without)"
        return False, "off (predicted not to fit with it either, GPU or host)"
    if cfg.train.objective != "sft":
        return False, f"off (train.objective {cfg.train.objective}: not measured with it)"
    if machine.world_size > 1:
        return False, "off (several processes: not measured with it)"
    tokens = round((seq if typical_row is None else typical_row) * cfg.train.micro_batch_size)
    if tokens < OFFLOAD_MIN_TOKENS:
        return False, (f"off ({tokens:,} tokens a micro-batch typically: its work on the host would show in the "
                       f"step; from {OFFLOAD_MIN_TOKENS:,} the GPU's work hides it)")
    exposed = found.time_parts["activation offload copies"]
    if exposed > OFFLOAD_EXPOSED_FRACTION * found.step_s:
        return False, (f"off (predicted with it: its copies outlast the GPU's work by {exposed:.2f} s of a "
                       f"{found.step_s:.2f} s step)")
    if not within_host:
        return False, (f"off (predicted with it: {found.peak_host_gib:.1f} GiB of host memory, over "
                       f"{AUTO_SPEND_HOST_FRACTION:.0%} of the host's {host:.1f})")
    return True, (f"on ({tokens:,} tokens a micro-batch typically: its copies predicted to hide under the GPU's "
                  f"work, within {OFFLOAD_EXPOSED_FRACTION:.0%} of the step, and the host has the memory)")


def _median(lengths: Callable[[], np.ndarray]) -> float | None:
    rows = lengths()
    return float(np.median(rows)) if len(rows) else None


def _save_projections(model: Skeleton, cfg: Config, machine: Machine, seq: int
                      ) -> tuple[bool, str, Estimate | None]:
    """(whether `cfg`, compile decided, keeps its blocks' projections under `auto`, why in a few words, and the
    prediction with them where they are kept, which is then the run's): where blocks are checkpointed inside their
    compiled graphs and the run keeping their projections is predicted to peak within AUTO_SPEND_GPU_FRACTION of the
    GPU's memory and within AUTO_SPEND_HOST_FRACTION of the host's (activation offload moves them there)."""
    trial = copy.deepcopy(cfg)
    trial.parallel.ac_save_projections = True
    found = estimate(model, trial, machine, seq)
    if not found.traced_checkpoints:
        return False, "off (no block is checkpointed inside its compiled graph)", None
    budget, host = machine.gpu.memory_gib * AUTO_SPEND_GPU_FRACTION, machine.host_mem_gib
    if host is not None and found.peak_host_gib > host * AUTO_SPEND_HOST_FRACTION:
        return False, (f"off (predicted with it: {found.peak_host_gib:.1f} GiB of host memory, over "
                       f"{AUTO_SPEND_HOST_FRACTION:.0%} of the host's {host:.1f})"), None
    if found.peak_gpu_gib > budget:
        return False, (f"off (predicted with it: {found.peak_gpu_gib:.1f} GiB per GPU, over {budget:.1f}, "
                       f"{AUTO_SPEND_GPU_FRACTION:.0%} of the GPU's {machine.gpu.memory_gib:.1f})"), None
    return True, (f"on (predicted with it: {found.peak_gpu_gib:.1f} GiB per GPU, within {AUTO_SPEND_GPU_FRACTION:.0%} "
                  f"of the GPU's {machine.gpu.memory_gib:.1f})"), found


def _guarded(predict):
    """`predict()`, where a failure other than the input's (which the build would refuse a moment later) only
    warns: a prediction that fails must not stop a run that may well fit."""
    try:
        return predict()
    except QShardError:
        raise
    except Exception as exc:
        log.warning("qshard plan could not predict this run (%s: %s); training goes on unchecked",
                    type(exc).__name__, exc)
        return None


def _auto_fit(cfg: Config, machine: Machine, model_dir: Path | None, vocab_size: int | None) -> list:
    """The fastest setting predicted to fit (or the smallest peak), as (dotted key, value) overrides; logged."""
    model = plan_model(cfg, machine.world_size, model_dir, vocab_size)
    # fp32 scales here were chosen (by the user, or by the checkpoint being resumed, whose adapters trained on that
    # base): the settings applied leave the base as it is.
    fitting, smallest = _search(model, compile_planned(cfg), machine, cfg.data.max_length, 1, model_dir, vocab_size,
                                offer_double_quant=False)
    chosen = fitting[0] if fitting else smallest
    fit = "predicted to fit" if fitting else "the smallest predicted peak, still over the GPU's memory"
    log.info("--auto-fit: %s (%s: %.2f GiB per GPU, %.0f tok/s)", chosen.flags(), fit,
             chosen.estimate.peak_gpu_gib, chosen.estimate.tok_s)
    return chosen.overrides


def _warn_if_not_fitting(found: Estimate, machine: Machine) -> None:
    if not found.fits:
        log.warning("predicted not to fit: %.2f GiB per GPU of %.1f, %.1f GiB host of %.1f; `qshard plan --fit` "
                    "with the same options suggests settings that fit (or pass --auto-fit)", found.peak_gpu_gib,
                    machine.gpu.memory_gib, found.peak_host_gib, machine.host_mem_gib or 0)


def compile_planned(cfg: Config, triton: bool | None = None) -> Config:
    """`cfg` with parallel.compile as a run on a CUDA GPU decides it (`auto`: parallel/compile.py, compile_choice;
    `triton`: whether that machine has Triton, None: as this one does)."""
    return with_compile_decided(cfg, compile_choice(cfg.parallel, torch.device("cuda"), triton)[0])


def _typed(current, text: str):
    if isinstance(current, bool) or text in ("true", "false"):  # parallel.compile may still say auto
        return text == "true"
    return type(current)(text) if current is not None else int(text)
