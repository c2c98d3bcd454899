"""The step time `qshard plan` predicts: a roofline of the blocks' matmuls, the head, attention and the
dequantization on the GPU, the host's kernel launches where they bound the step, the all-gathers and gradient
reductions over the GPU links, host <-> GPU copies for offload, and AdamW on the host under cpu_offload."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from qshard.adapters import LoRALinear
from qshard.build import Skeleton
from qshard.config import REFERENCE_OBJECTIVES, Config
from qshard.parallel.checkpointing import checkpointed_blocks
from qshard.parallel.fsdp import reshard_after_forward
from qshard.planner import hardware
from qshard.planner.activations import kept_projections
from qshard.planner.hardware import Machine
from qshard.planner.layout import TensorPlan, per_skeleton, plan_mesh
from qshard.precision import precision
from qshard.quant import QuantizedLinear
from qshard.train.loss import chunks_loss

if TYPE_CHECKING:
    from qshard.planner.estimate import Shapes


def head_trains(plans: list[TensorPlan]) -> bool:
    """Whether the output head trains (lora.modules_to_save, full fine-tuning): its weight's gradient costs too."""
    return any(p.trainable and "lm_head" in p.name for p in plans)


def runs_sdpa(model: Skeleton) -> bool:
    """Whether the model as built runs sdpa attention, whose kernels kept projections keep with them
    (parallel/checkpointing.py); an architecture without it is built with eager attention (models.py), which the
    traced checkpoint recomputes."""
    return getattr(model.model.config, "_attn_implementation", None) == "sdpa"


def head_gradient_in_forward(model: Skeleton, cfg: Config, plans: list[TensorPlan]) -> bool:
    """Whether the loss takes the head's gradient in forward (train/loss.py, `_FrozenHeadCE`): a frozen head under
    the chunked loss, outside fp16. Otherwise the logits are computed again in backward (a chunked loss) or kept for
    it (the full logits), with their fp32 gradient."""
    return (not head_trains(plans) and precision(cfg).compute != torch.float16
            and chunks_loss(model.model, cfg.train.loss_chunk_tokens))


def step_times(model: Skeleton, cfg: Config, plans: list[TensorPlan], shapes: Shapes, machine: Machine,
               offloaded_activations: float, traced: bool) -> dict[str, float]:
    """Seconds per optimizer step, by part (their sum is the step). `offloaded_activations`: the bytes per
    micro-batch activation offload moves out (and back); `traced`: blocks checkpointed inside their compiled graphs
    (where ac_save_projections takes effect, and NF4 weights are dequantized once in backward)."""
    g, p = machine.gpu, cfg.parallel
    micro = cfg.train.grad_accum
    ckpt = len(checkpointed_blocks(model.blocks, p)) / max(shapes.blocks, 1)
    frozen, trained, quantized = _linear_params(model)
    t = shapes.step_tokens
    # Forward 2 FLOPs per weight and token, the input's gradient 2, the weight's gradient 2 where it trains;
    # checkpointed blocks run their forward again in backward.
    matmul = t * (2 * (frozen + trained) * (2 + ckpt) + 2 * trained)
    if p.mlp_tile_tokens and t > p.mlp_tile_tokens:
        # Each tile's forward runs again in its backward (parallel/tiling.py); a non-reentrant checkpoint's
        # recompute then skips the MLP, so only blocks not checkpointed that way run it once more.
        again = 1.0 if p.ac_reentrant else 1.0 - ckpt
        matmul += t * 2 * _mlp_params(model) * again
    # The head's forward and its input's gradient; where the head's gradient is not taken in forward, the chunked
    # loss computes its logits again in backward (train/loss.py), and a head that trains its own gradient.
    head = t * shapes.vocab * shapes.hidden * (2 * 2 + (0 if head_gradient_in_forward(model, cfg, plans) else 2)
                                               + (2 if head_trains(plans) else 0))
    # Causal attention: QK^T and PV, half the matrix; backward about 2.5 forwards; once more if recomputed.
    recomputed_attention = ckpt
    if traced and p.saves_projections():  # kept, not recomputed: the projections, sdpa's attention
        matmul -= t * 2 * ckpt * sum(w for b in model.blocks for _, _, w in kept_projections(b))
        recomputed_attention = 0.0 if runs_sdpa(model) else recomputed_attention
    if p.ac_keep_attention:  # the recompute takes the forward's attention (parallel/kept_attention.py)
        recomputed_attention = 0.0
    per_pass = 2 * shapes.attention_tokens * shapes.seq * shapes.attn_dim * shapes.blocks
    attention = per_pass * (1 + 2.5 + recomputed_attention)
    # Gradient-free forwards beside the step's own: a preference reference, KTO's mismatched pairs.
    extra = extra_forwards(cfg)
    matmul += extra * t * 2 * (frozen + trained)
    head += extra * t * shapes.vocab * shapes.hidden * 2
    attention += extra * per_pass
    eager = 1.0 if p.compile else hardware.EAGER_GPU_FACTOR

    def gpu_seconds(matmul_flops: float, attention_flops: float, dequantized: float) -> float:
        """GPU time of matmul and attention FLOPs and of `dequantized` weights dequantized (one per use)."""
        return (matmul_flops / (g.tflops * 1e12 * hardware.MATMUL_EFFICIENCY)
                + attention_flops / (g.tflops * 1e12 * hardware.ATTENTION_EFFICIENCY)
                + dequantized * (0.5 + 2 * shapes.compute) / (g.hbm_gbs * 1e9 * hardware.COPY_EFFICIENCY)) * eager

    # Each quantized weight is dequantized in forward and backward, and again for a hooks checkpoint's recompute; a
    # traced checkpoint's recompute shares backward's NF4 weights (quant/nf4.py, _NF4MatmulInTracedCheckpoint and
    # _NF4MatmulBesideLowRank).
    recomputed = 0.0 if traced and cfg.quant.method == "nf4" else ckpt
    gpu = gpu_seconds(matmul + head, attention, quantized * (2 + recomputed + extra))
    # The step's own forward, which activation offload's copies out overlap: the blocks' matmuls once, the head's
    # (its input's gradient too where taken in forward), attention once, each weight dequantized once.
    head_forward = t * shapes.vocab * shapes.hidden * (4 if head_gradient_in_forward(model, cfg, plans) else 2)
    forward = gpu_seconds(t * 2 * (frozen + trained) + head_forward, per_pass, quantized)
    # Blocks used in place (their storage or adapters held in place; only the embedding and head are otherwise)
    # run as compiled graphs without a unit's hooks.
    graphs = p.compile and shapes.blocks_in_place
    launch = "cuda_graph" if p.replays_graphs() else "graph" if graphs else "hooks"
    launches = shapes.blocks * hardware.HOST_PER_BLOCK_S[launch]
    # Activation offload's hooks add host work that shows only where the host then outlasts the GPU.
    host = launches + (shapes.blocks * hardware.HOST_OFFLOAD_PER_BLOCK_S if offloaded_activations else 0.0)
    link = _link_seconds(cfg, plans, machine)
    pcie = _pcie_seconds(cfg, plans, machine)
    # Activation offload copies on a side stream: out while forward computes, back a block ahead while backward
    # does (parallel/offload.py); only the part of either direction that outlasts its pass adds to the step.
    copy = offloaded_activations / (g.pcie_gbs * 1e9 * hardware.COPY_EFFICIENCY)
    # (gradient-free forwards, a preference reference's, save nothing: neither pass's)
    activations = max(0.0, copy - forward) + max(0.0, copy - (gpu - forward * (1 + extra)))
    busy = max(gpu, host, link, pcie)
    times = {
        "compute": gpu * micro,
        "host-bound (kernel launches)": (max(host, gpu) - gpu + hardware.HOST_EXPOSED * min(launches, gpu)) * micro,
        "exposed communication (links, PCIe)": (max(link, pcie, gpu, host) - max(gpu, host)) * micro,
        "activation offload copies": activations * micro,
        "fixed per step": hardware.STEP_FIXED_S,
    }
    trained_host = sum(x.local_rows * x.row_bytes // x.dtype.itemsize for x in plans if x.trainable and x.on_host)
    times["host AdamW"] = trained_host / hardware.HOST_ADAM_PARAMS_PER_S
    assert busy >= gpu
    return times


def _linear_params(model: Skeleton) -> tuple[int, int, int]:
    """Weights of the blocks' matmuls: frozen, trained, and of those frozen the quantized ones."""
    return per_skeleton(_count_linear_params, model)


def _count_linear_params(model: Skeleton) -> tuple[int, int, int]:
    frozen = trained = quantized = 0
    for block in model.blocks:
        for module in block.modules():
            if isinstance(module, QuantizedLinear):
                frozen += module.in_features * module.out_features
                quantized += module.in_features * module.out_features
            elif isinstance(module, nn.Linear):
                n = module.in_features * module.out_features
                if module.weight.requires_grad:
                    trained += n
                else:
                    frozen += n
            elif isinstance(module, LoRALinear):
                trained += module.rank * (module.in_features + module.out_features)
    return frozen, trained, quantized


def extra_forwards(cfg: Config) -> int:
    """Gradient-free forwards of a micro-batch's tokens besides training's (train/preference.py): the reference's
    (the base with the adapters off) unless precomputed, and KTO's mismatched pairs through policy and reference."""
    objective = cfg.train.objective
    reference = objective in REFERENCE_OBJECTIVES and not cfg.pref.precompute_reference
    return int(reference) + (2 if objective == "kto" else 0)


def _mlp_params(model: Skeleton) -> int:
    """Weights of the matmuls inside the blocks' MLPs (their adapters' included)."""
    return per_skeleton(_count_mlp_params, model)


def _count_mlp_params(model: Skeleton) -> int:
    total = 0
    for block in model.blocks:
        mlp = getattr(block, "mlp", None)
        for module in mlp.modules() if isinstance(mlp, nn.Module) else ():
            if isinstance(module, (QuantizedLinear, nn.Linear)):
                total += module.in_features * module.out_features
            elif isinstance(module, LoRALinear):
                total += module.rank * (module.in_features + module.out_features)
    return total


def _link_seconds(cfg: Config, plans: list[TensorPlan], machine: Machine) -> float:
    """All-gathers of the sharded weights (forward, and again in backward unless grad_op) and the reduction
    of the gradients, per micro-batch, over the GPU links; replicas all-reduce over the network."""
    mesh = plan_mesh(cfg, machine.world_size)
    g = machine.gpu
    if mesh.shard == 1 and mesh.replicas == 1:
        return 0.0
    share = (mesh.shard - 1) / mesh.shard
    gathers = 2 if reshard_after_forward(cfg.parallel) else 1
    weights = sum(p.full_bytes for p in plans if p.holder != "in_place")
    grads = sum(p.full_bytes // p.dtype.itemsize * precision(cfg).reduce.itemsize for p in plans if p.trainable)
    intra = (weights * gathers + grads) * share
    across = grads / mesh.shard * 2 * (mesh.replicas - 1) / mesh.replicas
    link_bw = g.link_gbs if machine.nodes == 1 or mesh.shard <= machine.gpus_per_node else g.net_gbs
    net_bw = g.net_gbs if machine.nodes > 1 else g.link_gbs
    return intra / (link_bw * 1e9 * hardware.COPY_EFFICIENCY) + across / (net_bw * 1e9 * hardware.COPY_EFFICIENCY)


def _pcie_seconds(cfg: Config, plans: list[TensorPlan], machine: Machine) -> float:
    """Host <-> GPU copies per micro-batch: offloaded shards in for every gather (the DTensor window for each
    pass), gradients out."""
    p = cfg.parallel
    copied = 0.0
    if p.cpu_offload:
        passes = 2 if reshard_after_forward(p) else 1
        dtensor = sum(x.local_bytes for x in plans if x.on_host and x.holder == "dtensor")
        fsdp = sum(x.stored_bytes for x in plans if x.on_host and x.holder == "fsdp")
        copied += fsdp * passes + dtensor * 3 + sum(x.stored_bytes for x in plans if x.trainable and x.on_host)
    return copied / (machine.gpu.pcie_gbs * 1e9 * hardware.COPY_EFFICIENCY)
