"""The machines `qshard plan` predicts for: a small table of GPU kinds (peak dense bf16 matmul rate, memory and
its bandwidth, host link, GPU-to-GPU link), and the efficiencies that turn peaks into what qshard reaches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qshard.errors import QShardError


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # what torch reports as the device's total memory
    tflops: float  # peak dense bf16 matmul TFLOP/s
    hbm_gbs: float  # device memory bandwidth, GB/s
    pcie_gbs: float  # host <-> device, GB/s per direction, as pinned copies reach it
    link_gbs: float  # GPU <-> GPU within a node (NVLink, or PCIe without it), GB/s per direction
    net_gbs: float = 50.0  # GPU <-> GPU across nodes (e.g. 400 Gb/s InfiniBand per GPU)


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h200", 139.8, 989.0, 4800.0, 50.0, 450.0),
    GPU("h100", 79.1, 989.0, 3350.0, 50.0, 450.0),
    GPU("h100-pcie", 79.1, 756.0, 2000.0, 50.0, 50.0),
    GPU("b200", 178.0, 2250.0, 8000.0, 50.0, 900.0),
    GPU("a100", 79.2, 312.0, 2039.0, 24.0, 300.0),
    GPU("a100-40", 39.4, 312.0, 1555.0, 24.0, 300.0),
    GPU("l40s", 44.4, 362.0, 864.0, 24.0, 24.0, 12.5),
    GPU("a6000", 47.5, 155.0, 768.0, 24.0, 24.0, 12.5),
    GPU("4090", 23.6, 165.0, 1008.0, 24.0, 24.0, 12.5),
    GPU("3090", 23.6, 71.0, 936.0, 24.0, 24.0, 12.5),
)}

# Fractions of the peaks that training reaches: the matmuls of a block (measured 687-716 of 989 TFLOP/s on an
# H200), fused attention, and the copies (device memory, host link, GPU links).
MATMUL_EFFICIENCY = 0.71
ATTENTION_EFFICIENCY = 0.53
COPY_EFFICIENCY = 0.8
# Host work per block per step, seconds: compiled blocks used in place (one GPU, quantized base) run a graph
# each way; blocks in FSDP2 units (a bf16 base, several GPUs, offload) add their units' hooks and a hooks-based
# checkpoint, and eager blocks launch every op. At 2,048 tokens an 8B LoRA or full step is bound by it. Blocks
# replayed as CUDA graphs (parallel.cuda_graphs) launch one graph each way.
HOST_PER_BLOCK_S = {"cuda_graph": 0.001, "graph": 0.002, "hooks": 0.0103}
# Activation offload's work on the host, per block and micro-batch: its hooks pack each saved tensor (a pool
# buffer, a copy queued on the side stream, events) and bring the groups back. Fitted on an H200, 8B, 2026-12-04:
# at 2,048 tokens, where the host already nearly bounds the step, the offload cost 27% (9,188 against 12,5xx
# tok/s); at 8,192, where the GPU's work hides it, nothing (12,142 against 12,124).
HOST_OFFLOAD_PER_BLOCK_S = 0.0035
# The share of the smaller of host and GPU time that still shows in a step: kernels launched while the GPU has
# run dry (a block's start, the waits between forward and backward).
HOST_EXPOSED = 0.21
# Uncompiled blocks run norms, rotary, activations and LoRA's arithmetic as separate kernels, each reading and
# writing the activations: GPU time per token this much above a compiled block's.
EAGER_GPU_FACTOR = 1.4
# The fixed cost of a step (loss, clipping, optimizer launch, logging), seconds.
STEP_FIXED_S = 0.03
# AdamW on the host (cpu_offload): parameters stepped per second by torch's fused implementation (train/optim.py).
HOST_ADAM_PARAMS_PER_S = 2.0e9


def gpu(kind: str, memory_gib: float | None = None) -> GPU:
    """The table's entry for `kind`, with `memory_gib` in place of its memory if given (a cap, a smaller card)."""
    if kind not in GPUS:
        raise QShardError(f"--gpu-kind: unknown GPU '{kind}' (known: {', '.join(GPUS)})")
    return with_memory(GPUS[kind], memory_gib)


def with_memory(found: GPU, memory_gib: float | None) -> GPU:
    """`found` with `memory_gib` (--gpu-mem) in place of its memory, if given."""
    if memory_gib is None:
        return found
    if memory_gib <= 0:
        raise QShardError(f"--gpu-mem must be > 0 GiB, got {memory_gib}")
    return dataclasses.replace(found, memory_gib=memory_gib)


def calibrated(base: GPU) -> GPU:
    """`base` with this machine's GPU measured instead (--calibrate, a few seconds): a bf16 matmul's rate, a
    device-to-device copy and a pinned host-to-device copy, each turned back into the table's peak terms by the
    efficiencies above, so that the predictions use them as they use the table's. GPU links keep `base`'s."""
    import torch

    if not torch.cuda.is_available():
        raise QShardError("--calibrate measures this machine's GPU, and there is none here (no CUDA)")
    device = torch.device("cuda", torch.cuda.current_device())
    n = 8192
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    matmul = _seconds(lambda: a @ b, 20)
    flat = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    copy = _seconds(lambda: flat.clone(), 10)
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    pcie = _seconds(lambda: host.to(device, non_blocking=True), 5)
    return dataclasses.replace(
        base, name=f"{torch.cuda.get_device_name(device)} (measured)",
        memory_gib=torch.cuda.get_device_properties(device).total_memory / 2**30,
        tflops=2 * n**3 / matmul / 1e12 / MATMUL_EFFICIENCY,
        hbm_gbs=2 * flat.numel() / copy / 1e9 / COPY_EFFICIENCY,  # read and write
        pcie_gbs=host.numel() / pcie / 1e9 / COPY_EFFICIENCY)


def _seconds(work, repeats: int) -> float:
    """The median seconds of `work` on the current CUDA stream, after a warm-up call."""
    import torch

    work()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


@dataclass
class Machine:
    """What the run is predicted on."""

    gpu: GPU
    nodes: int = 1
    gpus_per_node: int = 1
    host_mem_gib: float | None = None  # per node; None: not checked

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node
