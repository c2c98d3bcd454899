"""Command line: `qshard train ...`, `qshard make-checkpoint ...`, `qshard export ...`, `qshard expand ...`.

Every configuration key can be set as `--section.key VALUE` (or `--section.key=VALUE`); the common
ones also have short flags. Order of precedence: defaults < `--config FILE` < flags, in order given.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import typing
import uuid
from pathlib import Path

import psutil

from qshard import config as config_mod
from qshard.errors import CollectiveError, QShardError
from qshard.rundir import full_disk_error

log = logging.getLogger("qshard")

# Set by `launch` for the processes it starts: where each writes its QShardError's message (rank<N>.txt)
# instead of printing it, so that the launcher prints each distinct error once, whichever ranks raised it.
ERROR_DIR_ENV = "QSHARD_ERROR_DIR"
# Set by `launch` for the processes it starts: its pid, so that each can arrange to die with it.
LAUNCHER_PID_ENV = "QSHARD_LAUNCHER_PID"
# What `launch` passes on to the ranks: preemption (they finish the step, save and exit 0) and Ctrl-C.
PREEMPTION = (signal.SIGTERM, signal.SIGUSR1)
FORWARDED = (*PREEMPTION, signal.SIGINT)
# After a Ctrl-C, how long the ranks get to stop before the launcher kills them.
INTERRUPT_GRACE_S = 10.0
# How often the launcher passes signals on and looks at its ranks.
WATCH_INTERVAL_S = 0.05
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies

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
    grow = sub.add_parser("expand", help="add identity-initialized blocks to a checkpoint (Llama-Pro)")
    grow.add_argument("--model", required=True, help="the model directory to expand")
    grow.add_argument("--output", required=True, help="the new model directory (must not exist, or be empty)")
    grow.add_argument("--new-blocks", type=int, required=True, help="blocks to add; must divide the layer count")
    grow.add_argument("--max-shard-gib", type=float, help="largest safetensors file (default: as the input's)")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """argparse, with `train`'s short flags first spelled as their dotted keys: argparse would apply the
    flags it knows before the `--section.key` ones it does not, and flags must apply in the order given."""
    if argv[:1] == ["train"]:
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


def _launched() -> bool:
    """True inside a process that torchrun, our launcher or srun started."""
    return "LOCAL_RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def launch(nproc: int, argv: list[str]) -> int:
    """Start `nproc` copies of this command through torchrun's launcher (one node, a free port), pass the
    signals the user or a scheduler sends on to them, and report how they ended in a line or two."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Each process would otherwise start one thread per core and they would fight over them.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.2,
    )
    supervisor = _Supervisor()
    with tempfile.TemporaryDirectory(prefix="qshard-errors-") as errors:
        os.environ[ERROR_DIR_ENV] = errors
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        try:
            supervisor.run(lambda: elastic_launch(config, sys.executable)("-m", "qshard", *argv))
        except ChildFailedError as exc:
            failures = {rank: (f.pid, f.exitcode) for rank, f in exc.failures.items()}
            return _report_failures(Path(errors), nproc, supervisor, failures)
        finally:
            del os.environ[ERROR_DIR_ENV], os.environ[LAUNCHER_PID_ENV]
    return 0


class _Supervisor:
    """Runs torch's launcher in a thread of its own and meanwhile, in the main thread, passes signals on
    to the ranks and watches them. In a thread torch's launcher installs no signal handlers; in the main
    one it would turn SIGTERM into an exception that tears the ranks down, and SIGUSR1 would kill it alone.

    SIGTERM and SIGUSR1 (preemption) reach every rank, which finishes its step, saves and exits 0; SIGINT
    (Ctrl-C) reaches them too, and ranks still running INTERRUPT_GRACE_S later (or at a second Ctrl-C) are
    killed. Once a rank has exited, a rank found stopped (SIGSTOP) is killed: it could never act on the
    SIGTERM torch's launcher tears the others down with, and the launcher would wait for it."""

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        self.relayed: set[tuple[int, int]] = set()  # (pid, index in received)
        self.seen: set[int] = set()  # every rank's pid, once it ran
        self.first_dead: set[int] | None = None  # the ranks found exited when any first was
        self.killed: dict[int, str] = {}  # pid -> why the launcher killed that rank
        self.interrupted_at: float | None = None

    def run(self, launcher: typing.Callable[[], object]) -> None:
        """Call `launcher` in another thread while relaying signals; raise what it raised."""
        outcome: list[BaseException] = []

        def target() -> None:
            try:
                launcher()
            except BaseException as exc:  # handed to the main thread
                outcome.append(exc)

        thread = threading.Thread(target=target, name="qshard-launcher")
        previous = {sig: signal.signal(sig, self._received) for sig in FORWARDED}
        try:
            thread.start()
            while thread.is_alive():
                thread.join(WATCH_INTERVAL_S)
                self._watch()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if outcome:
            raise outcome[0]

    def _received(self, signum: int, _frame) -> None:
        # The main thread's loop acts on it within WATCH_INTERVAL_S: nothing here that could race with it.
        self.received.append(signal.Signals(signum))

    def _watch(self) -> None:
        ranks = _running_children()
        self.seen.update(p.pid for p in ranks)
        for index, sig in enumerate(self.received):
            for rank in ranks:
                if (rank.pid, index) not in self.relayed:
                    self.relayed.add((rank.pid, index))
                    self._signal(rank.pid, sig)
        if signal.SIGINT in self.received and self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
        interrupted = self.interrupted_at is not None and (
            self.received.count(signal.SIGINT) > 1 or time.monotonic() - self.interrupted_at > INTERRUPT_GRACE_S
        )
        dead = self.seen - {p.pid for p in ranks}
        if dead and self.first_dead is None:
            self.first_dead = dead
        for rank in ranks:
            if interrupted:
                self._kill(rank.pid, "interrupted")
            elif self.first_dead is not None and _stopped(rank):
                self._kill(rank.pid, "stopped")

    def _kill(self, pid: int, why: str) -> None:
        self.killed.setdefault(pid, why)
        self._signal(pid, signal.SIGKILL)

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.kill(pid, sig)


def _running_children() -> list[psutil.Process]:
    """This process's children that have not exited (the ranks: torch's launcher starts no other)."""
    children = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE:
                children.append(child)
    return children


def _stopped(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


def _report_failures(errors: Path, nproc: int, supervisor: _Supervisor, failures: dict[int, tuple[int, int]]) -> int:
    """Say why the ranks failed, naming the rank at fault rather than those that failed because of it;
    returns the exit code. `failures`: rank -> (pid, exit code), negative for a signal."""
    if signal.SIGINT in supervisor.received:
        print("qshard: interrupted: the ranks stopped without saving a checkpoint", file=sys.stderr)
        return 130
    if _print_worker_errors(errors, nproc):
        return 2
    preempted = [sig for sig in supervisor.received if sig in PREEMPTION]
    if preempted and any(code == -preempted[0] for _, code in failures.values()):
        print(f"qshard: {preempted[0].name} reached the ranks outside the training loop (while loading or after "
              "the last step): they stopped without saving a checkpoint", file=sys.stderr)
        return 128 + preempted[0]
    collective = {int(path.stem[len("collective-rank"):]): path.read_text()
                  for path in errors.glob("collective-rank*.txt")}
    causes, others = _failed_ranks(supervisor, failures, set(collective))
    lines = causes or [*(f"error: {collective[rank]}" for rank in sorted(collective)), *others]
    for line in lines or [f"rank {', '.join(map(str, sorted(failures)))} failed"]:
        print(f"qshard: {line}", file=sys.stderr)
    return 1


def _failed_ranks(supervisor: _Supervisor, failures: dict[int, tuple[int, int]], reported: set[int]
                  ) -> tuple[list[str], list[str]]:
    """(the ranks that failed first and said nothing: dead, or exited with an error code; those the launcher
    killed), each as a line, leaving out ranks that reported a collective's failure and ranks that torch's
    launcher stopped after the first failure."""
    causes: dict[int, int] = {}
    others = []
    for rank, (pid, code) in sorted(failures.items()):
        if rank in reported:
            continue
        why = supervisor.killed.get(pid)
        if why == "stopped":
            others.append(f"rank {rank} was stopped (suspended) while the others waited for it; the launcher "
                          "killed it")
        elif supervisor.first_dead is not None and pid not in supervisor.first_dead:
            if code == -signal.SIGKILL:  # torch's launcher kills what its SIGTERM did not stop
                others.append(f"rank {rank} did not stop when the run was torn down and was killed")
        else:
            causes[rank] = code
    # A SIGTERM beside another cause is torch's launcher stopping that rank because of it.
    if any(code != -signal.SIGTERM for code in causes.values()):
        causes = {rank: code for rank, code in causes.items() if code != -signal.SIGTERM}
    return [_death(rank, code) for rank, code in causes.items()], others


def _death(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} died ({signal.Signals(-code).name})"
    return f"rank {rank} exited with code {code}"


def _die_with_launcher() -> None:
    """In a rank that `launch` started: be killed when the launcher dies, even by SIGKILL. torch's launcher
    starts each rank in a session of its own, so nothing else would stop it (Linux only)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or not _launched() or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(launcher):  # it died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


def _print_worker_errors(errors: Path, nproc: int) -> bool:
    """Print each distinct error the workers reported once, naming the ranks unless all of them or rank 0
    raised it (an error only some ranks saw, e.g. a file only they could not read, would otherwise be lost:
    rank 0 alone prints). Returns whether any worker reported one."""
    by_message: dict[str, list[int]] = {}
    for path in sorted(errors.glob("rank*.txt"), key=lambda p: int(p.stem[4:])):
        by_message.setdefault(path.read_text(), []).append(int(path.stem[4:]))
    for message, ranks in by_message.items():
        where = "" if 0 in ranks or len(ranks) == nproc else f" (rank {', '.join(map(str, ranks))})"
        print(f"qshard: error{where}: {message}", file=sys.stderr)
    return bool(by_message)


def _report_error(exc: QShardError) -> None:
    """One line, even when a library's message we pass on spans several: printed by rank 0 (every rank
    usually meets the same bad input), handed to our launcher by the processes it started, and printed
    with its rank by the other ranks of an outside launcher (torchrun, srun), which may be alone in it.
    A collective's failure names its rank and is each rank's own: every rank prints it, and our launcher
    gets it apart from the other errors (it names the rank at fault instead, when it knows one)."""
    message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    rank, errors = _rank(), os.environ.get(ERROR_DIR_ENV)
    collective = isinstance(exc, CollectiveError)
    if errors and _launched():
        (Path(errors) / f"{'collective-' if collective else ''}rank{rank}.txt").write_text(message)
    elif rank == 0 or collective:
        print(f"qshard: error: {message}", file=sys.stderr)
    else:
        print(f"qshard: error (rank {rank}): {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _die_with_launcher()
    _setup_logging()
    try:
        args, extra = parse_args(argv)
        if args.command == "make-checkpoint":
            return _make_checkpoint(args, extra)
        if args.command == "export":
            return _export(args, extra)
        if args.command == "expand":
            return _expand(args, extra)
        cfg = parse_train_config(args, extra)
        if cfg.parallel.nproc > 1 and not _launched():
            return launch(cfg.parallel.nproc, argv)
        from qshard.train.run import run_training  # heavy imports only once the config is valid

        run_training(cfg)
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

    run_export(args.kind, Path(args.run), args.checkpoint, Path(args.out) if args.out else None, args.max_shard_gib)
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
