"""One run's prediction: each rank's peak GPU memory and its parts, the host's memory while loading and while
training, the step time and tok/s, and whether it fits. Built from the tensor layout (layout.py) and the
activations the skeleton saves (activations.py); the constants that are not sizes live in hardware.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from qshard.build import Skeleton, random_init
from qshard.config import PAIR_OBJECTIVES, REFERENCE_OBJECTIVES, Config, checkpoint_trace_unmet
from qshard.loading.read_ahead import CUDA_STAGING_BYTES
from qshard.models import prompt_tokens_shared, shares_prompt
from qshard.parallel.checkpointing import checkpointed_blocks
from qshard.parallel.fsdp import reshard_after_forward
from qshard.planner.activations import BlockActivations, adapts_attention_output, probe_activations
from qshard.planner.hardware import Machine
from qshard.planner.layout import TensorPlan, per_skeleton, plan_mesh, state_sizes, storage_block_bytes, tensor_layout
from qshard.planner.speed import extra_forwards, head_gradient_in_forward, head_trains, runs_sdpa, step_times
from qshard.precision import precision
from qshard.quant import QuantizedLinear
from qshard.train.grad_sum import defers_grad_sum

GIB = 2**30
# The transient memory of backward through one recomputed block, as a multiple of what its forward saves
# (gradients of its intermediates beside the recomputed tensors): higher where the checkpoint is traced into a
# compiled graph, whose backward holds more of the recomputed tensors at once than hooks recomputing them eagerly.
WORKING_SET_FACTOR = {"traced": 1.6, "hooks": 1.35}
# Saved tensors on the GPU under activation offload: the block backward is in and the one brought back ahead.
OFFLOAD_KEPT_BLOCKS = 2
# What the caching allocator holds beyond the live tensors at the peak (rounding, blocks not yet reused).
ALLOCATOR_RESERVE = 0.03
# The share of a GPU's memory a run may be predicted to peak at and still fit: the predictions are of allocated
# memory, and the allocator's cache (blocks split and not yet reused), the CUDA context and the prediction's own
# error come on top of it.
USABLE_GPU_FRACTION = 0.9
# Host memory of a training process before any model state: CUDA context, torch and its libraries, the data.
HOST_BASE_GIB = 4.0


@dataclass
class Estimate:
    """The prediction, in GiB and seconds; `parts` is the largest rank's breakdown."""

    peak_gpu_gib_per_rank: list[float]
    parts: dict[str, float]
    host_parts: dict[str, float]
    peak_host_gib: float  # per node, the larger of loading and training
    loading_host_gib: float
    step_s: float
    tok_s: float
    time_parts: dict[str, float]
    machine: Machine
    tokens_per_step: int
    notes: list[str] = field(default_factory=list)
    # Whether blocks are checkpointed inside their compiled graphs (where ac_save_projections takes effect).
    traced_checkpoints: bool = False

    @property
    def peak_gpu_gib(self) -> float:
        return max(self.peak_gpu_gib_per_rank)

    @property
    def usable_gpu_gib(self) -> float:
        return self.machine.gpu.memory_gib * USABLE_GPU_FRACTION

    @property
    def fits_gpu(self) -> bool:
        return self.peak_gpu_gib <= self.usable_gpu_gib

    @property
    def fits_host(self) -> bool:
        return self.machine.host_mem_gib is None or self.peak_host_gib <= self.machine.host_mem_gib

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    def to_json(self) -> dict:
        m = self.machine
        return {
            "fits": self.fits, "fits_gpu": self.fits_gpu, "fits_host": self.fits_host,
            "peak_gpu_gib": round(self.peak_gpu_gib, 6),
            "peak_gpu_gib_per_rank": [round(x, 6) for x in self.peak_gpu_gib_per_rank],
            "gpu_mem_gib": m.gpu.memory_gib, "usable_gpu_gib": round(self.usable_gpu_gib, 3),
            "peak_host_gib": round(self.peak_host_gib, 3),
            "loading_host_gib": round(self.loading_host_gib, 3), "host_mem_gib": m.host_mem_gib,
            "tok_s": round(self.tok_s, 1), "step_s": round(self.step_s, 4), "tokens_per_step": self.tokens_per_step,
            "parts": {k: round(v, 6) for k, v in self.parts.items()},
            "host_parts": {k: round(v, 6) for k, v in self.host_parts.items()},
            "time_parts": {k: round(v, 5) for k, v in self.time_parts.items()},
            "gpu_kind": m.gpu.name, "nodes": m.nodes, "gpus_per_node": m.gpus_per_node, "notes": self.notes,
        }


def estimate(model: Skeleton, cfg: Config, machine: Machine, seq: int, acts: BlockActivations | None = None,
             cache: dict | None = None) -> Estimate:
    """The prediction for `cfg` on `machine` with sequences of `seq` tokens (the longest a micro-batch holds).
    `acts` and `cache` (of layouts): what a caller comparing many settings of one model reuses (`--fit`)."""
    acts = acts or probe_activations(model, cfg)
    world = machine.world_size
    mesh = plan_mesh(cfg, world)
    p = cfg.parallel
    key = (p.cpu_offload, p.sharding, p.quant_sharding, p.replicate_degree, p.resident_blocks,
           cfg.model.looks_up_on_host())
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = [tensor_layout(model, cfg, world, rank) for rank in range(mesh.shard)]
    layouts = cache[key]
    shapes = Shapes(model, cfg, seq, world)
    index = _block_index(model)
    # Blocks used in place (no FSDP2 unit: parallel/fsdp.py, in_place_blocks), as the layout placed them.
    shapes.blocks_in_place = any(x.holder == "in_place" and x.name in index for x in layouts[0])
    peaks, parts = [], None
    for plans in layouts:
        rank_parts = _gpu_parts(model, cfg, plans, acts, shapes)
        peaks.append(sum(rank_parts.values()) / GIB)
        parts = parts if parts is not None and sum(parts.values()) >= sum(rank_parts.values()) else rank_parts
    host_parts, loading = _host_parts(model, cfg, layouts[0], acts, shapes, machine)
    offloaded = _offloaded_activations(model, cfg, acts, shapes)
    traced = _traced(cfg, shapes)
    times = step_times(model, cfg, layouts[0], shapes, machine, offloaded, traced)
    step = sum(times.values())
    tokens = shapes.step_tokens * cfg.train.grad_accum * world
    return Estimate(
        peak_gpu_gib_per_rank=[peaks[mesh.shard_index(r)] for r in range(world)],
        parts={k: v / GIB for k, v in parts.items()},
        host_parts={k: v / GIB for k, v in host_parts.items()},
        peak_host_gib=max(sum(host_parts.values()), loading) / GIB,
        loading_host_gib=loading / GIB,
        step_s=step, tok_s=tokens / step, time_parts=times, machine=machine, tokens_per_step=tokens,
        notes=_notes(cfg, shapes), traced_checkpoints=traced,
    )


class Shapes:
    """The sizes the formulas read, from the skeleton's config and the run's options."""

    def __init__(self, model: Skeleton, cfg: Config, seq: int, world: int) -> None:
        self.world = world
        text = model.model.config.get_text_config()
        self.seq = seq
        # per micro-batch per rank; a pair objective's micro-batch is its pairs' chosen and rejected rows, or under
        # pref.share_prompt one row a pair of its prompt (counted once) and both completions. Memory is planned for
        # the longest such row (a short prompt, two long completions: as many tokens as two rows); the step's
        # compute and tokens for a prompt of pref.max_prompt_length (`step_tokens`).
        rows = 2 if cfg.train.objective in PAIR_OBJECTIVES else 1
        self.tokens = self.step_tokens = cfg.train.micro_batch_size * rows * seq
        # A shared row's attention is two causal passes (attention.py): the prompt's self-attention runs in both.
        self.attention_tokens = self.tokens
        if shares_prompt(cfg, model.model.config, cfg.model.attn_implementation):
            self.step_tokens = cfg.train.micro_batch_size * (2 * seq - prompt_tokens_shared(cfg, seq))
        self.hidden = text.hidden_size
        head = model.model.get_output_embeddings()
        self.vocab = head.weight.shape[0] if head is not None else text.vocab_size
        head_dim = getattr(text, "head_dim", None)
        self.attn_dim = text.num_attention_heads * head_dim if head_dim else self.hidden
        self.heads = text.num_attention_heads
        self.compute = precision(cfg).compute.itemsize
        self.blocks = len(model.blocks)
        self.blocks_in_place = False  # set from the layout (estimate)


def _block_index(model: Skeleton) -> dict[str, int]:
    """Parameter name -> its block's index (names outside blocks are absent)."""
    return per_skeleton(_walk_block_index, model)


def _quantized_shapes(model: Skeleton) -> list[list[tuple[int, int]]]:
    """Each block's quantized linears as (out, in)."""
    return per_skeleton(_walk_quantized_shapes, model)


def _walk_quantized_shapes(model: Skeleton) -> list[list[tuple[int, int]]]:
    return [[(m.out_features, m.in_features) for m in b.modules() if isinstance(m, QuantizedLinear)]
            for b in model.blocks]


def _walk_block_index(model: Skeleton) -> dict[str, int]:
    ids = {id(b): i for i, b in enumerate(model.blocks)}
    found = {}
    for name, module in model.model.named_modules():
        if id(module) in ids:
            for pname, _ in module.named_parameters():
                found[f"{name}.{pname}"] = ids[id(module)]
    return found


def _gpu_parts(model: Skeleton, cfg: Config, plans: list[TensorPlan], acts: BlockActivations,
               shapes: Shapes) -> dict[str, float]:
    """One rank's GPU memory at its peak, by part, in bytes."""
    sizes = state_sizes(plans)
    w = sizes.weights
    parts = {
        "quantized storage": w.get("quantized", 0),
        "frozen weights": w.get("frozen", 0),
        "embedding and head": w.get("embedding", 0) + w.get("head", 0),
        "trained weights": w.get("trained", 0),
        "AdamW state": 0 if sizes.on_host else sizes.optimizer,
    }
    parts["gathered blocks"] = _gathered(model, cfg, plans, shapes)
    parts["dequantized weights"] = _dequantized_at_peak(model, cfg, shapes)
    dynamic = _activation_phases(model, cfg, plans, acts, shapes)
    parts.update(dynamic)
    parts["communication buffers"] = _comm_buffers(model, cfg, plans)
    parts["allocator reserve"] = ALLOCATOR_RESERVE * sum(parts.values())
    return parts


def _gathered(model: Skeleton, cfg: Config, plans: list[TensorPlan], shapes: Shapes) -> float:
    """Blocks' weights gathered by FSDP2 at once: the block running and the one prefetched (every block under
    grad_op, which keeps them from forward to backward), and the head, which stays gathered from the loss through
    backward unless the loss takes its gradient in forward (then `_activation_phases` counts it at the loss only);
    storage in DTensor buffers is gathered a layer at a time."""
    index = _block_index(model)
    per_block = [0.0] * shapes.blocks
    layer = 0.0
    for plan in plans:
        if plan.holder == "dtensor":
            layer = max(layer, plan.full_bytes)
        if plan.holder == "fsdp" and plan.name in index:
            per_block[index[plan.name]] += _gathered_bytes(plan, cfg, shapes)
    per_block.sort(reverse=True)
    in_flight = shapes.blocks if not reshard_after_forward(cfg.parallel) else min(2, shapes.blocks)
    head = 0.0 if head_gradient_in_forward(model, cfg, plans) else _gathered_head(plans, cfg, shapes)
    return sum(per_block[:in_flight]) + head + 2 * layer


def _gathered_head(plans: list[TensorPlan], cfg: Config, shapes: Shapes) -> float:
    """The head's weights as its FSDP2 unit gathers them (none where it has no unit)."""
    return sum(_gathered_bytes(p, cfg, shapes) for p in plans if p.holder == "fsdp" and p.part == "head")


def _gathered_bytes(plan: TensorPlan, cfg: Config, shapes: Shapes) -> float:
    if not plan.dtype.is_floating_point:
        return plan.full_bytes
    return plan.full_bytes // plan.dtype.itemsize * _gathered_itemsize(plan, cfg, shapes)


def _gathered_itemsize(plan: TensorPlan, cfg: Config, shapes: Shapes) -> int:
    # Units of quantized blocks cast nothing (their adapters travel as fp32 masters); the others cast to compute.
    if cfg.train.train_type in ("qlora", "qdora") and plan.trainable:
        return plan.dtype.itemsize
    return shapes.compute


def _dequantized_at_peak(model: Skeleton, cfg: Config, shapes: Shapes) -> float:
    """Dense weights alive at once: the one a matmul dequantized; in the backward of an NF4 block checkpointed inside
    its compiled graph, every weight the recompute reads, each alive until its input's gradient (quant/nf4.py,
    _NF4MatmulInTracedCheckpoint, or widened by a LoRA B factor's rank columns, left out here: 1.6% at rank 64 of
    4,096 inputs, _NF4MatmulBesideLowRank): with kept projections the widening ones (gate, up), else taken as all of a
    block's but its largest (for Llama that counts o_proj where down_proj is left out, 3% of a block apart)."""
    blocks = _quantized_shapes(model)
    largest = max((o * i for b in blocks for o, i in b), default=0)
    if not (_traced(cfg, shapes) and cfg.quant.method == "nf4"):
        return largest * shapes.compute
    if cfg.parallel.saves_projections():
        recomputed = [sum(o * i for o, i in b if o > i) for b in blocks]
    else:
        recomputed = [sum(o * i for o, i in b) - max((o * i for o, i in b), default=0) for b in blocks]
    return max([largest, *recomputed]) * shapes.compute


def _activation_phases(model: Skeleton, cfg: Config, plans: list[TensorPlan], acts: BlockActivations,
                       shapes: Shapes) -> dict[str, float]:
    """The activations, loss chunk and gradients at the step's peak phase: the loss (what every block keeps for
    backward), or backward through block i (what the blocks before it keep, block i's working set: its saved
    tensors, recomputed or kept, with the gradients of its intermediates; the gradients of the blocks after it),
    or the optimizer step (every gradient), or a gradient-free forward (a reference, KTO's mismatched rows)."""
    p, t = cfg.parallel, shapes.tokens
    kept = _kept_per_block(model, cfg, acts, shapes)
    if p.offloads_activations():  # every block's saved tensors go to the host, but those in use and in flight
        top = set(sorted(range(len(kept)), key=lambda i: -kept[i])[:OFFLOAD_KEPT_BLOCKS])
        kept = [k if i in top else 0.0 for i, k in enumerate(kept)]
    grads = [0.0] * (shapes.blocks + 1) if p.cpu_offload else _grads_by_block(model, plans, shapes.blocks)
    outside = t * acts.outside
    logit_gradient_held = not head_gradient_in_forward(model, cfg, plans)
    # Where the loss reshards the head before backward (train/loss.py), its gathered weight counts in the forwards only:
    # the loss's, and the gradient-free ones (gathered by the head's own forward and kept until that loss).
    head = 0.0 if logit_gradient_held else _gathered_head(plans, cfg, shapes)
    loss = _loss_chunk(cfg, shapes, logit_gradient_held) + outside + head
    # (kept by the blocks, working set, loss chunk, gradients) of each phase
    # ac_keep_attention: kept beside the checkpoints by every checkpointed block until its backward, per block.
    kept_attention = _kept_attention(model, cfg, shapes) / shapes.blocks
    factor = WORKING_SET_FACTOR["traced" if _traced(cfg, shapes) else "hooks"]
    phases = [(sum(kept) + kept_attention * shapes.blocks, 0.0, loss, grads[-1] if head_trains(plans) else 0.0)]
    for i in reversed(range(shapes.blocks)):
        working = _block_working_set(cfg, acts, shapes, i) * factor + outside
        phases.append((sum(kept[:i]) + kept_attention * i, working, 0.0, sum(grads[i:])))
    phases.append((0.0, 0.0, 0.0, sum(grads)))
    phases = [(*phase, 0.0) for phase in phases]
    if extra_forwards(cfg):
        phases.append((0.0, 0.0, 0.0, _grads_beside_no_grad_forward(cfg, grads),
                       _no_grad_forward(cfg, acts, shapes, logit_gradient_held) + head))
    kept_at, working_at, loss_at, grads_at, no_grad_at = max(phases, key=sum)
    return {"checkpointed activations": kept_at, "recompute working set": working_at, "loss chunk": loss_at,
            "gradients": grads_at, "gradient-free forward": no_grad_at}


def _no_grad_forward(cfg: Config, acts: BlockActivations, shapes: Shapes, logit_gradient_held: bool) -> float:
    """What a gradient-free forward of a micro-batch (the reference's, KTO's mismatched rows) holds at its peak
    beside the weights (bytes): the block running, whose tensors are freed once used, so at most what it would
    save for backward (an upper bound), with its input; or the head's part. Only per-row log-probs outlive it."""
    t = shapes.tokens
    block = max(_block_working_set(cfg, acts, shapes, i) for i in range(shapes.blocks)) + t * acts.block_input
    return max(block + t * acts.outside, _no_grad_head(cfg, shapes, logit_gradient_held))


def _no_grad_head(cfg: Config, shapes: Shapes, logit_gradient_held: bool) -> float:
    """The head's per-token log-probs without gradient (train/loss.py, token_logps): one chunk's logits in the
    compute dtype and their fp32 copy (and, where the head's gradient is not taken in forward: `_ChunkedHeadCE`,
    the full logits, their log-softmax); the final hidden states, their copy without each row's last position and
    the trained positions' rows; each token's label (int64, and its shifted copy) and log-prob."""
    t = shapes.tokens
    chunk = min(cfg.train.loss_chunk_tokens or t, t)
    per_logit = shapes.compute + 4 + (4 if logit_gradient_held else 0)
    return chunk * shapes.vocab * per_logit + 3 * t * shapes.hidden * shapes.compute + 20 * t


def _grads_beside_no_grad_forward(cfg: Config, grads: list[float]) -> float:
    """The gradients alive during the gradient-free forwards: none for KTO's mismatched rows, run for the whole
    step before its first backward; the earlier micro-batches' for a reference run beside each micro-batch's own
    forward (train/preference.py)."""
    reference = cfg.train.objective in REFERENCE_OBJECTIVES and not cfg.pref.precompute_reference
    return sum(grads) if reference and cfg.train.grad_accum > 1 else 0.0


def _block_working_set(cfg: Config, acts: BlockActivations, shapes: Shapes, i: int) -> float:
    """What block i saves for its backward (bytes): under parallel.mlp_tile_tokens its MLP keeps its input and
    one tile's intermediates at a time (parallel/tiling.py), not the whole sequence's."""
    t, tile = shapes.tokens, cfg.parallel.mlp_tile_tokens
    if not tile or t <= tile:
        return t * acts.saved[i]
    return t * (acts.saved[i] - acts.mlp[i] + acts.block_input) + tile * acts.mlp[i]


def _kept_per_block(model: Skeleton, cfg: Config, acts: BlockActivations, shapes: Shapes) -> list[float]:
    """What each block keeps from forward to backward (bytes), which activation offload moves but the last's: a
    checkpointed block its input, and where its checkpoint is traced under ac_save_projections the projections
    it keeps inside its compiled graph and, with sdpa attention (whose kernels the policy keeps too,
    parallel/checkpointing.py), attention's output, and where an adapter trains on the output projection, that
    output once more as the projection's input, laid out by token (its A factor's gradient reads it; the graph's
    saved tensors pass through the offload's hooks, which logged exactly that much on an H200, 2026-12-04: 1,148
    KiB a token for 31 blocks of 8B); any other block all it saves (of a tiled MLP, its input and one tile's)."""
    ckpt = {id(b) for b in checkpointed_blocks(model.blocks, cfg.parallel)}
    kept_inside = _traced(cfg, shapes) and cfg.parallel.saves_projections()
    sdpa = kept_inside and runs_sdpa(model)

    def attention(block) -> float:
        if not sdpa:
            return 0.0
        relaid = shapes.attention_tokens * shapes.attn_dim * shapes.compute if adapts_attention_output(block) else 0
        return _attention_output_bytes(shapes) + relaid

    return [shapes.tokens * (acts.block_input + (acts.projections[i] if kept_inside else 0)) + attention(b)
            if id(b) in ckpt else _block_working_set(cfg, acts, shapes, i) for i, b in enumerate(model.blocks)]


def _offloaded_activations(model: Skeleton, cfg: Config, acts: BlockActivations, shapes: Shapes) -> float:
    """What activation offload moves to the host per micro-batch (bytes): what every block but the last keeps (the
    last block and the head keep theirs on the GPU, parallel/offload.py)."""
    if not cfg.parallel.offloads_activations():
        return 0.0
    return sum(_kept_per_block(model, cfg, acts, shapes)[:-1])


def _kept_attention(model: Skeleton, cfg: Config, shapes: Shapes) -> float:
    """Under parallel.ac_keep_attention: each checkpointed block's attention output, held on the GPU from its
    forward to its backward (parallel/kept_attention.py)."""
    if not cfg.parallel.ac_keep_attention:  # refused without checkpointing (config.py)
        return 0.0
    return len(checkpointed_blocks(model.blocks, cfg.parallel)) * _attention_output_bytes(shapes)


def _attention_output_bytes(shapes: Shapes) -> float:
    """One block's attention output (compute dtype) and log-sum-exp (fp32, one a head and token)."""
    return shapes.attention_tokens * (shapes.attn_dim * shapes.compute + shapes.heads * 4)


def _traced(cfg: Config, shapes: Shapes) -> bool:
    """Whether checkpoints are traced into compiled graphs: the rule allows it and blocks are used in place
    (parallel/fsdp.py, traced_blocks)."""
    unmet = checkpoint_trace_unmet(cfg.parallel, cfg.train.train_type, cfg.lora.dropout, shapes.world)
    return not unmet and shapes.blocks_in_place


def _grads_by_block(model: Skeleton, plans: list[TensorPlan], blocks: int) -> list[float]:
    """Gradient bytes of each block, then of everything outside the blocks (last)."""
    index = _block_index(model)
    grads = [0.0] * (blocks + 1)
    for plan in plans:
        if plan.trainable:
            grads[index.get(plan.name, blocks)] += plan.stored_bytes
    return grads


def _loss_chunk(cfg: Config, shapes: Shapes, logit_gradient_held: bool) -> float:
    """The head's logits of one loss chunk (train/loss.py): in the compute dtype and their fp32 copy, which a frozen
    head's gradient (taken in forward) overwrites, or else beside their fp32 gradient (`logit_gradient_held`); all
    the micro-batch's tokens at once when the loss is not chunked."""
    chunk = cfg.train.loss_chunk_tokens or shapes.tokens
    chunk = min(chunk, shapes.tokens)
    per_logit = shapes.compute + 4 + (4 if logit_gradient_held else 0)
    return chunk * shapes.vocab * per_logit + shapes.tokens * shapes.hidden * shapes.compute


def _comm_buffers(model: Skeleton, cfg: Config, plans: list[TensorPlan]) -> float:
    """The reduce-scatter of one block's gradients: the block's whole gradients in the reduce dtype."""
    index = _block_index(model)
    reduce = precision(cfg).reduce.itemsize
    per_block: dict[int, float] = {}
    for plan in plans:
        if plan.trainable and plan.holder == "fsdp" and plan.name in index:
            i = index[plan.name]
            per_block[i] = per_block.get(i, 0) + plan.full_bytes // plan.dtype.itemsize * reduce
    return max(per_block.values(), default=0.0)


# ---------------------------------------------------------------------------------------------------------------
# Host memory.


def _host_parts(model: Skeleton, cfg: Config, plans: list[TensorPlan], acts: BlockActivations, shapes: Shapes,
                machine: Machine) -> tuple[dict[str, float], float]:
    """A node's host memory while training, by part, and its peak while loading (bytes)."""
    ranks = machine.gpus_per_node
    sizes = state_sizes(plans)
    pinned = sum(_pinned(p.stored_bytes) for p in plans if p.on_host and p.holder == "fsdp")
    if cfg.parallel.quant_sharding == "dtensor" and cfg.parallel.cpu_offload:
        # Page-locked at their exact size (parallel/storage_offload.py).
        pinned += sum(storage_block_bytes(plans, model))
    trained = [p for p in plans if p.trainable and p.on_host]
    # In host buffers page-locked at their exact size and reused across steps (parallel/offload.py, HostPool).
    offloaded_acts = _offloaded_activations(model, cfg, acts, shapes)
    parts = {
        "process and libraries": HOST_BASE_GIB * GIB * ranks,
        "offloaded weights (pinned)": pinned * ranks,
        "offloaded gradients": sum(p.stored_bytes for p in trained) * ranks,
        # parallel.defer_grad_accumulation: the earlier micro-batches' sum, held beside the new gradients in backward;
        # FSDP2's asynchronous copies land in pinned memory, one allocation per parameter.
        "held gradient sum": sum(_pinned(p.stored_bytes) for p in trained) * ranks if defers_grad_sum(cfg) else 0.0,
        "offloaded AdamW state": (sizes.optimizer if sizes.on_host else 0) * ranks,
        # model.embedding_on_host: each rank's own copy of the input embedding, in pageable memory.
        "input embedding": sum(p.stored_bytes for p in plans if p.on_host and p.holder == "in_place") * ranks,
        "offloaded activations (pinned)": offloaded_acts * ranks,
        # The tokenized data is memory-mapped (data/store.py): page cache, not the process's. What is its own:
        # a step's batch and the next one prefetched, ids, labels and positions as int64, pinned on CUDA, and
        # under model.embedding_on_host each micro-batch's rows (on the GPU one at a time, as the first block's
        # input, which the activations count).
        "data batches": (_pinned(2 * 3 * 8 * shapes.tokens * cfg.train.grad_accum) + _host_rows(cfg, shapes)) * ranks,
    }
    # Loading: each rank's offloaded shards exist from the start, and a checkpoint's tensors pass through the
    # read-ahead's ring of pinned buffers (loading/read_ahead.py); random weights are generated on the GPU.
    ring = 0 if random_init(cfg) else CUDA_STAGING_BYTES
    loading = parts["process and libraries"] + parts["offloaded weights (pinned)"] + parts["input embedding"] + \
        ring * ranks
    return parts, loading


def _host_rows(cfg: Config, shapes: Shapes) -> float:
    """model.embedding_on_host: a step's and the next step's micro-batches' embedding rows, pinned (bytes)."""
    if not cfg.model.looks_up_on_host():
        return 0.0
    return 2 * cfg.train.grad_accum * _pinned(shapes.tokens * shapes.hidden * shapes.compute)


def _pinned(nbytes: float) -> float:
    """torch's pinned-memory allocator rounds each allocation up to a power of two."""
    return float(1 << max(0, int(nbytes - 1).bit_length())) if nbytes > 0 else 0.0


def _notes(cfg: Config, shapes: Shapes) -> list[str]:
    notes = []
    if cfg.parallel.saves_projections() and not _traced(cfg, shapes):
        notes.append("parallel.ac_save_projections has no effect here (no block's checkpoint is traced)")
    return notes
