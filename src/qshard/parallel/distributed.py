"""Process-group setup that works the same under `qshard train`, torchrun and SLURM's srun."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

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


def init_distributed(cpu_collectives: bool = False) -> DistEnv:
    """Join (or create) the process group and build the 1-D data-parallel mesh.

    A lone process gets a world of one through an in-memory store, so that training always runs
    through FSDP2, whatever the world size. `cpu_collectives` adds gloo beside NCCL for tensors that
    live on the CPU: under CPU offload the gradient-norm reduction runs on CPU gradient shards."""
    _adopt_slurm_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend, **kwargs)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world_size = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    return DistEnv(dist.get_rank(), world_size, local_rank, device, mesh)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
