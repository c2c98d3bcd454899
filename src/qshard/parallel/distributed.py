"""Process-group setup that works the same under `qshard train`, torchrun and SLURM's srun."""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from qshard.errors import CollectiveError, QShardError

T = TypeVar("T")

# Words of the backends' messages (gloo's RuntimeError, NCCL's DistBackendError) for a collective that waited
# past its timeout, and for one whose peer went away (died, or had its connections torn down).
_TIMED_OUT = ("timed out", "timeout")
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "communicator was aborted")
# Words of torch.distributed's function names (c10d's API, FSDP2's collectives) that say which collective a
# failing frame ran, checked in order ("foreach_reduce" is FSDP2's reduce-scatter of gradients).
_COLLECTIVES = (
    ("reduce_scatter", "reduce-scatter"), ("foreach_reduce", "reduce-scatter"), ("all_gather", "all-gather"),
    ("all_reduce", "all-reduce"), ("broadcast", "broadcast"), ("barrier", "barrier"), ("all_to_all", "all-to-all"),
)


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    # The collective timeout in force and the option that set it ("parallel.timeout_s: 600 s"), for the
    # message of a collective that times out.
    timeout: str = "torch's default timeout"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _adopt_slurm_env() -> None:
    """Under `srun` (one task per GPU) SLURM says who we are; torch.distributed reads torchrun's names.
    MASTER_ADDR/MASTER_PORT must come from the job script (see README)."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def init_distributed(cpu_collectives: bool = False, timeout: tuple[str, float] | None = None) -> DistEnv:
    """Join (or create) the process group and build the 1-D data-parallel mesh.

    A lone process gets a world of one through an in-memory store, so that training always runs
    through FSDP2, whatever the world size. `cpu_collectives` adds gloo beside NCCL for tensors that
    live on the CPU: under CPU offload the gradient-norm reduction runs on CPU gradient shards.
    `timeout`: (the option that sets it, seconds) a collective waits for the other ranks; None: torch's default."""
    _adopt_slurm_env()
    # A collective that fails inside a forward passes FSDP2's hooks on its way out, and torch warns (over
    # several lines) of what it silenced there: the failure itself is reported in one line instead.
    warnings.filterwarnings("ignore", message="module forward hook with ``always_call=True`` raised an exception")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        delta = None if timeout is None else timedelta(seconds=timeout[1])
        # The rank's GPU, named: collectives (barriers too) then need not guess it, and torch does not warn.
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=delta, **kwargs)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=delta, **kwargs)
    world_size = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    env = DistEnv(dist.get_rank(), world_size, local_rank, device, mesh)
    if timeout is not None:
        env.timeout = f"{timeout[0]}: {timeout[1]:g} s"
    return env


def add_cpu_collectives() -> None:
    """Give the run's process group gloo for tensors in host memory where it began without (a setting chosen
    after the group started: --auto-fit's parallel.cpu_offload); nothing where it has them. Every rank calls it.
    The backend joins the group itself rather than a new group: the mesh, FSDP2 and the gradient norm's
    reduction (train/optim.py) use the group they were given, and set_timeout reaches it there."""
    group = c10d._get_default_group()
    if torch.device("cpu") in group._device_types:
        return
    present = group._get_backend(group._device_types[0])
    timeout = getattr(getattr(present, "options", None), "_timeout", c10d.default_pg_timeout)
    # The ranks meet in the group's own store, under keys of their own.
    store = dist.PrefixStore("qshard-cpu-collectives", c10d._get_default_store())
    gloo = dist.ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(), timeout)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    # Groups made from now on (a hybrid mesh's) take the default group's backends: gloo for the host too.
    both = f"cpu:gloo,{c10d._world.pg_backend_config[group]}"
    c10d._world.pg_map[group] = (both, c10d._world.pg_map[group][1])
    c10d._world.pg_backend_config[group] = both


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def set_timeout(env: DistEnv, option: str, seconds: float) -> None:
    """From now on every process group of this rank (the default one, the mesh's, the checkpoint writer's)
    gives up a collective after `seconds`; `option` is the setting they come from."""
    # Every rank gets here under the old timeout first: a rank done early would otherwise wait under the
    # new, shorter one for a rank still at work that the old one allows (the end of loading, say).
    dist.barrier()
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    env.timeout = f"{option}: {seconds:g} s"


@contextlib.contextmanager
def collective_errors(env: DistEnv, where: Callable[[], str] = str) -> Iterator[None]:
    """A collective that times out or loses a peer inside this block becomes a CollectiveError of one line,
    naming this rank, the collective, `where()` it ran (e.g. " at step 12") and the timeout in force,
    instead of the backend's traceback. Other errors pass unchanged."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc).lower()
        if any(words in text for words in _TIMED_OUT):
            what = f"timed out waiting for the other ranks ({env.timeout}): one of them stopped or hung"
        elif any(words in text for words in _PEER_LOST):
            what = "lost its connection to another rank, which died or was stopped"
        else:
            raise
        raise CollectiveError(f"rank {env.rank}: {_collective(exc)}{where()} {what}") from None


def _collective(exc: BaseException) -> str:
    """The collective a backend error was raised in, from the innermost torch.distributed frame that names one."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if f"torch{os.sep}distributed" in frame.filename:
            name = next((name for word, name in _COLLECTIVES if word in frame.name), None)
            if name is not None:
                return name
    return "a collective"


# ---------------------------------------------------------------------------------------------------------------
# Work that rank 0 alone does, whose outcome (a result or an error) every rank shares.


def one_line(exc: Exception) -> str:
    """A QShardError's own message; anything else (an OSError reading the files, ...) named by its type."""
    return str(exc) if isinstance(exc, QShardError) else f"on rank 0: {type(exc).__name__}: {exc}"


def from_rank0(compute: Callable[[], T], is_main: bool) -> T:
    """`compute()` run on rank 0 only, its result given to every rank; an error it raises is raised on
    every rank as a QShardError (a collective: no rank waits forever for a rank 0 that failed)."""
    box: list = [None]
    if is_main:
        try:
            box[0] = ("ok", compute())
        except Exception as exc:
            box[0] = ("error", one_line(exc))
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise QShardError(value)
    return value


@contextlib.contextmanager
def held_by_rank0(enter: Callable[[], AbstractContextManager], is_main: bool) -> Iterator[None]:
    """Hold the context `enter()` makes (a run directory's lock) on rank 0 for the duration of the block;
    its refusal is every rank's error (a collective)."""
    with contextlib.ExitStack() as held:

        def hold() -> None:
            held.enter_context(enter())

        from_rank0(hold, is_main)
        yield
