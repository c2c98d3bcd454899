"""`qshard train --nproc N`: start N ranks on this machine through torch's launcher, pass the signals a user or a
scheduler sends on to them, tie their lives to the launcher's, and say in a line or two how they ended
(naming the rank at fault, not those that failed because of it). Also what a rank started this way does on
its side: die with the launcher, and hand its one-line error to it rather than print it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import tempfile
import threading
import time
import typing
import uuid
from pathlib import Path

import psutil

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


def launched() -> bool:
    """True inside a process that torchrun, our launcher or srun started."""
    return "LOCAL_RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def launch(nproc: int, argv: list[str]) -> int:
    """Start `nproc` copies of this command through torchrun's launcher (one node, a free port), pass the
    signals the user or a scheduler sends on to them, and report how they ended in a line or two."""
    # torch's launcher only now: the command line reports bad options before any heavy import.
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


def die_with_launcher() -> None:
    """In a rank that `launch` started: be killed when the launcher dies, even by SIGKILL. torch's launcher
    starts each rank in a session of its own, so nothing else would stop it (Linux only)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or not launched() or not sys.platform.startswith("linux"):
        return
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
