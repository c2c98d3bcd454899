"""Command line: `qshard train ...`, `qshard make-checkpoint ...`, `qshard export ...`, `qshard expand ...`,
`qshard plot ...`, `qshard generate ...`.

Every configuration key can be set as `--section.key VALUE` (or `--section.key=VALUE`); the common
ones also have short flags. Order of precedence: defaults < `--config FILE` < flags, in order given.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
import typing
from pathlib import Path

from qshard import config as config_mod
from qshard import launcher
from qshard.errors import CollectiveError, QShardError
from qshard.rundir import full_disk_error
from qshard.train.trackers import check_installed

log = logging.getLogger("qshard")

# Short flags for the keys scripts set most; each maps to one dotted key.
SHORTCUTS = {
    "--model": "model.path",
    "--data": "data.path",
    "--eval-data": "data.eval_path",
    "--output-dir": "output.dir",
    "--max-steps": "train.max_steps",
    "--epochs": "train.epochs",
    "--seed": "train.seed",
    "--train-type": "train.train_type",
    "--nproc": "parallel.nproc",
    "--lr": "optim.lr",
    "--batch-size": "train.micro_batch_size",
    "--grad-accum": "train.grad_accum",
    "--max-length": "data.max_length",
    "--lora-rank": "lora.rank",
    "--resume": "checkpoint.resume",
    "--save-every": "checkpoint.every_steps",
    "--report-to": "output.trackers",
    "--init-adapter": "train.init_adapter",
}


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record, so that `main()` called in-process
    (tests, notebooks) follows a redirected stderr instead of holding on to the one it started with."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _setup_logging() -> None:
    level = logging.INFO if _rank() == 0 else logging.ERROR
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s qshard: %(message)s", datefmt="%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    # The launcher's own chatter (and its traceback of a child's exit) adds nothing to our one-line errors.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # transformers' advisory warnings repeat on every rank.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # bitsandbytes warns at import that an optional CPU kernel package is absent; its CPU path still works.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a flag without its value, an ambiguous prefix) become our one-line error
    instead of a usage dump and a SystemExit; subcommand parsers are of this class too."""

    def error(self, message: str) -> typing.NoReturn:
        raise QShardError(f"{message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qshard", description="FSDP2 + QLoRA fine-tuning of causal LMs")
    # Listed for --help; `main` answers it before parsing, since the parser requires a command.
    parser.add_argument("--version", action="store_true", help="print the versions of qshard and its libraries")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="fine-tune a model (no --model and --data: the embedded demo)",
        epilog="Any option in the configuration reference can also be set as --section.key VALUE.",
        allow_abbrev=False,  # a prefix of a short flag would escape the rewrite in parse_args
    )
    train.add_argument("--config", help="YAML file of options")
    for flag, key in SHORTCUTS.items():
        train.add_argument(flag, dest=key, metavar=key.split(".")[-1].upper(), help=f"sets {key}")
    train.add_argument("--overwrite", action="store_true", help="allow an output dir that holds a run")
    train.add_argument("--dry-run", action="store_true", help="check the config, model files and data, print "
                       "the plan of the run, and stop: nothing is trained or written")
    train.add_argument("--auto-fit", action="store_true", help="apply the fastest settings `qshard plan --fit` "
                       "predicts to fit this machine's GPUs (CUDA only), and log them")
    _plan_parser(sub)
    make = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint of a named shape")
    make.add_argument("--shape", required=True, help="e.g. llama3-8b, llama3-70b, llama-tiny")
    make.add_argument("--out", required=True, help="directory to write (must not exist, or be empty)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--layers", type=int, help="override num_hidden_layers")
    make.add_argument("--device", default="cpu", help="where to generate the random values (cpu, cuda)")
    exp = sub.add_parser("export", help="write a run's trained weights as a PEFT adapter or a merged model")
    exp.add_argument("kind", choices=["adapter", "merged"], help="adapter: PEFT format; merged: full HF model")
    exp.add_argument("--run", required=True, help="the run's output directory")
    exp.add_argument("--checkpoint", help="a checkpoint directory (default: the run's newest complete one)")
    exp.add_argument("--out", help="where to write (default: RUN/adapter or RUN/merged); an existing directory "
                     "must be empty or hold a previous qshard export of the same kind, and nothing else")
    exp.add_argument("--max-shard-gib", type=float, default=2.0, help="largest safetensors shard of a merged model")
    exp.add_argument("--base-name", help="the base model the export names (adapter_config.json's "
                     "base_model_name_or_path): a Hub id, id@revision, or a directory; default: the run's own")
    _generate_parser(sub)
    grow = sub.add_parser("expand", help="add identity-initialized blocks to a checkpoint (Llama-Pro)")
    grow.add_argument("--model", required=True, help="the model directory to expand")
    grow.add_argument("--output", required=True, help="the new model directory (must not exist, or be empty)")
    grow.add_argument("--new-blocks", type=int, required=True, help="blocks to add; must divide the layer count")
    grow.add_argument("--max-shard-gib", type=float, help="largest safetensors file (default: as the input's)")
    plot = sub.add_parser("plot", help="draw runs' loss, held-out loss, lr, tok/s and memory into one PNG")
    plot.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run output directories")
    plot.add_argument("--out", type=Path, help="the PNG (default: RUN/plot.png for one run, plot.png for several)")
    return parser


def _plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="predict a run's peak GPU and host memory and its speed, without loading it",
                          epilog="Takes qshard train's options (any --section.key VALUE too); no weight is read.",
                          allow_abbrev=False)
    plan.add_argument("--config", help="YAML file of options")
    for flag, key in SHORTCUTS.items():
        plan.add_argument(flag, dest=key, metavar=key.split(".")[-1].upper(), help=f"sets {key}")
    plan.add_argument("--overwrite", action="store_true", help=argparse.SUPPRESS)  # accepted, as train takes it
    plan.add_argument("--gpus", help="GPUs per node, or NODESxGPUS (e.g. 2x8) (default: parallel.nproc)")
    plan.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    plan.add_argument("--gpu-kind", default="h100", help="h200, h100, h100-pcie, b200, a100, a100-40, l40s, a6000, "
                      "4090, 3090 (default h100): speed constants and memory")
    plan.add_argument("--gpu-mem", type=float, help="GiB per GPU (default: the kind's)")
    plan.add_argument("--calibrate", action="store_true", help="measure this machine's GPU (matmul rate, memory and "
                      "PCIe bandwidth, a few seconds) instead of the --gpu-kind table's")
    plan.add_argument("--host-mem", type=float, help="GiB of host memory per node (default: not checked)")
    plan.add_argument("--seq", type=int, help="tokens per sequence (default: data.max_length)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--fit", action="store_true", help="also list the fastest settings predicted to fit")
    plan.add_argument("--top", type=int, default=5, help="how many --fit lists (default 5)")


def _generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="complete a prompt or chat with a run's model, or a base with a PEFT adapter",
                         epilog="With --model, any --section.key VALUE of the configuration reference sets how the "
                         "base is built (e.g. --quant.method hqq, --train.precision fp32).")
    gen.add_argument("--run", help="a run's output directory")
    gen.add_argument("--checkpoint", help="a checkpoint directory of the run (default: its newest complete one)")
    gen.add_argument("--model", help="a base model directory or Hub id, for --adapter")
    gen.add_argument("--adapter", help="a PEFT LoRA/DoRA adapter directory of --model")
    gen.add_argument("--prompt", help="the one prompt to complete (the chat template applied, if the model has one)")
    gen.add_argument("--chat", action="store_true", help="a conversation: one line of standard input per turn, "
                     "until /exit or end of input")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above: sampling")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default 1)")
    gen.add_argument("--max-new-tokens", type=int, default=256, help="longest answer in tokens (default 256)")
    gen.add_argument("--seed", type=int, default=0, help="the sampling's random seed (default 0)")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """argparse, with `train`'s short flags first spelled as their dotted keys: argparse would apply the
    flags it knows before the `--section.key` ones it does not, and flags must apply in the order given."""
    if argv[:1] in (["train"], ["plan"]):
        argv = [_spell_out(arg) for arg in argv]
    return _parser().parse_known_args(argv)


def _spell_out(arg: str) -> str:
    if arg == "--overwrite":
        return "--output.overwrite=true"
    flag, eq, value = arg.partition("=")
    return f"--{SHORTCUTS[flag]}{eq}{value}" if flag in SHORTCUTS else arg


def _dotted_overrides(extra: list[str]) -> list[tuple[str, str]]:
    """`--a.b value` / `--a.b=value` pairs from the arguments argparse did not know."""
    pairs, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg:
            raise QShardError(f"unknown argument '{arg}' (options are --section.key VALUE; see qshard train --help)")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):  # else the next option is no value
            i += 1
            value = extra[i]
        else:
            raise QShardError(f"option '{arg}' needs a value")
        pairs.append((key.replace("-", "_"), value))
        i += 1
    return pairs


def parse_train_config(args: argparse.Namespace, extra: list[str]) -> config_mod.Config:
    overrides = [(key, getattr(args, key)) for key in SHORTCUTS.values() if getattr(args, key) is not None]
    if args.overwrite:
        overrides.append(("output.overwrite", "true"))
    return config_mod.resolve(args.config, overrides + _dotted_overrides(extra))


def _report_error(exc: QShardError) -> None:
    """One line, even when a library's message we pass on spans several: printed by rank 0 (every rank
    usually meets the same bad input), handed to our launcher by the processes it started, and printed
    with its rank by the other ranks of an outside launcher (torchrun, srun), which may be alone in it.
    A collective's failure names its rank and is each rank's own: every rank prints it, and our launcher
    gets it apart from the other errors (it names the rank at fault instead, when it knows one)."""
    message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    rank, errors = _rank(), os.environ.get(launcher.ERROR_DIR_ENV)
    collective = isinstance(exc, CollectiveError)
    if errors and launcher.launched():
        (Path(errors) / f"{'collective-' if collective else ''}rank{rank}.txt").write_text(message)
    elif rank == 0 or collective:
        print(f"qshard: error: {message}", file=sys.stderr)
    else:
        print(f"qshard: error (rank {rank}): {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher.die_with_launcher()
    _setup_logging()
    try:
        if argv[:1] == ["--version"]:
            from qshard.versions import version_line

            print(version_line())
            return 0
        args, extra = parse_args(argv)
        if args.command in COMMANDS:
            return COMMANDS[args.command](args, extra)
        cfg = parse_train_config(args, extra)
        check_installed(cfg.output.trackers)
        if cfg.parallel.nproc > 1 and not launcher.launched() and not args.dry_run:  # a dry run plans the ranks
            return launcher.launch(cfg.parallel.nproc, argv)
        # Before the heavy imports: importing torch's compiler stack (torch._dynamo) fixes inductor's cache directory.
        from qshard.parallel.compile_cache import use_persistent_caches

        use_persistent_caches()
        from qshard.train.run import run_training  # heavy imports only once the config is valid

        run_training(cfg, dry_run=args.dry_run, auto_fit=args.auto_fit)
        return 0
    except QShardError as exc:
        _report_error(exc)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug, not bad input: full detail once, one line from the other ranks
        if (full := full_disk_error(exc)) is not None:  # nor is a full disk: one line
            _report_error(full)
            return 2
        if _rank() == 0:
            traceback.print_exc()
        else:
            print(f"qshard: rank {_rank()} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _make_checkpoint(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise QShardError(f"unknown argument '{extra[0]}' for make-checkpoint")
    from qshard.demo_tokenizer import build_demo_tokenizer
    from qshard.outputs import staged
    from qshard.random_model import named_config, write_random_checkpoint

    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    hf_config = named_config(args.shape, **overrides)
    tokenizer = build_demo_tokenizer()
    if hf_config.vocab_size < len(tokenizer):
        raise QShardError(
            f"--shape {args.shape}: vocabulary {hf_config.vocab_size} is smaller than the demo tokenizer's"
        )
    # Written whole into a fresh directory, which only then takes --out's name: a killed run leaves no
    # directory there that looks like a checkpoint, and nothing already there is overwritten.
    with staged(Path(args.out), "--out") as tmp:
        write_random_checkpoint(tmp, hf_config, seed=args.seed, device=args.device)
        # A small local tokenizer whose ids all fit the vocabulary, so the checkpoint trains as is.
        tokenizer.save_pretrained(tmp)
    log.info("wrote a random %s checkpoint (with the demo tokenizer) to %s", args.shape, args.out)
    return 0


def _export(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise QShardError(f"unknown argument '{extra[0]}' for export")
    from pathlib import Path

    from qshard.export_cmd import run_export

    run_export(args.kind, Path(args.run), args.checkpoint, Path(args.out) if args.out else None, args.max_shard_gib,
               args.base_name)
    return 0


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    from qshard.generate_cmd import Sampling, run_generate

    sampling = Sampling(args.temperature, args.top_p, args.max_new_tokens, args.seed)
    run_generate(args.run, args.checkpoint, args.model, args.adapter, _dotted_overrides(extra), args.prompt,
                 args.chat, sampling)
    return 0


def _expand(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise QShardError(f"unknown argument '{extra[0]}' for expand")
    if args.max_shard_gib is not None and args.max_shard_gib <= 0:
        raise QShardError(f"--max-shard-gib must be > 0, got {args.max_shard_gib}")
    from qshard.expand import expand_checkpoint

    shard = int(args.max_shard_gib * 2**30) if args.max_shard_gib else None
    new = expand_checkpoint(args.model, args.output, args.new_blocks, shard)
    log.info("wrote %s with %d new blocks (layers %s); train them with --train-type llama_pro",
             args.output, len(new), new)
    return 0


def _plot(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise QShardError(f"unknown argument '{extra[0]}' for plot")
    from qshard.plot_cmd import run_plot

    run_plot(args.runs, args.out)
    return 0


def _plan(args: argparse.Namespace, extra: list[str]) -> int:
    cfg = parse_train_config(args, extra)
    nodes, gpus = _nodes_and_gpus(args.gpus, args.nodes)
    for flag, value in (("--nodes", nodes), ("--top", args.top), ("--gpus", gpus)):
        if value is not None and value <= 0:
            raise QShardError(f"{flag} must be > 0, got {value}")
    from qshard.planner.command import run_plan
    from qshard.planner.hardware import Machine, calibrated, gpu, with_memory

    if args.host_mem is not None and args.host_mem <= 0:
        raise QShardError(f"--host-mem must be > 0 GiB, got {args.host_mem}")
    kind = gpu(args.gpu_kind)
    kind = with_memory(calibrated(kind) if args.calibrate else kind, args.gpu_mem)
    machine = Machine(kind, nodes, gpus or cfg.parallel.nproc, args.host_mem)
    return run_plan(cfg, machine, args.seq, args.json, args.fit, args.top)


def _nodes_and_gpus(gpus: str | None, nodes: int) -> tuple[int, int | None]:
    """--gpus N (per node, beside --nodes) or --gpus NODESxGPUS."""
    if gpus is None:
        return nodes, None
    parts = gpus.lower().split("x")
    if len(parts) > 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise QShardError(f"--gpus takes a number of GPUs per node or NODESxGPUS (e.g. 2x8), got '{gpus}'")
    if len(parts) == 2:
        return int(parts[0]), int(parts[1])
    return nodes, int(parts[0])


# The commands other than train, each (args, extra) -> exit code.
COMMANDS = {"make-checkpoint": _make_checkpoint, "export": _export, "expand": _expand, "plot": _plot,
            "generate": _generate, "plan": _plan}
