"""torch.compile for the transformer blocks.

Only each block's `forward` is compiled, not its `__call__`: FSDP2's hooks (all-gather, reshard) keep
running eagerly around the compiled graph, exactly as without compilation. Blocks of one class share one
compiled graph (modules are inlined, so their parameters are graph inputs rather than constants baked
into it; the first block's input requires grad like the others': first_block_shares_the_graph). Activation
checkpointing is traced into the graph of the blocks parallelize names (parallel/checkpointing.py:
traced_checkpoint); elsewhere its hooks run around the compiled forward.

`parallel.compile: auto` (the default) is decided here once per run, for the device it runs on
(`compile_choice`), and the compiled code is cached on disk, so that a later run of the same model and
configuration skips most of the compilation (`use_persistent_caches`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn

from qshard.adapters.lora import LoRALinear
from qshard.config import Config, ParallelConfig
from qshard.errors import QShardError
from qshard.parallel.checkpointing import traced_checkpoint
from qshard.parallel.compile_cache import use_persistent_caches
from qshard.parallel.grouped_matmuls import GroupSharedInputLinears
from qshard.parallel.tiling import compile_tiles
from qshard.quant import QuantizedLinear

log = logging.getLogger("qshard")

AUTO = "auto"

# Inductor's options for the blocks. Combo kernels launch independent small kernels of a graph as one (the
# casts of a block's fp32 LoRA weights to bf16, for one): fewer launches, where the step is bound by the host's.
# The pre-grad pass computes the adapters' A factors of layers that share an input as one matmul (grouped_matmuls.py).
INDUCTOR_OPTIONS = {"combo_kernels": True, "pre_grad_custom_pass": GroupSharedInputLinears()}
# parallel.cuda_graphs: inductor's CUDA graph trees. Each shape a block sees is recorded once, so the trainer pads
# every micro-batch to data.max_length (train/loop.py); generation runs eagerly (train/samples.py). Not with
# inductor's option to skip graphs of dynamic shapes: it splits static graphs too, into partitions whose inputs are
# copied at every replay (docs/benchmarks-history.md).
CUDA_GRAPH_OPTIONS = {"triton.cudagraphs": True}
# parallel.cuda_graphs auto: on where the training rows hold at least this share of the tokens that padding each to
# data.max_length makes (so the padding costs at most ~5% more compute), and a micro-batch is at most this many
# tokens: above it the host launches a block's kernels faster than the GPU runs them, and graphs save nothing
# (docs/benchmarks.md has the measurements).
GRAPH_ROWS_FILLED = 0.95
GRAPH_MAX_TOKENS = 4096
# ... and where the run has at least this many micro-batches: recording the graphs costs about as much start-up time
# (seconds) as this many micro-batches save. Where a block's backward recomputes a random op (attention, unless kept
# projections keep it) and torch cannot cache graphs with graph-safe random state (`keep_graphs_cacheable`), the
# blocks compile again in each run, a start-up the larger number repays (`graph_min_micro_batches`).
GRAPH_MIN_MICRO_BATCHES = 200
GRAPH_MIN_MICRO_BATCHES_RECOMPILED = 1000


def compile_blocks(
    blocks: list[nn.Module], backend: str, checkpointed: list[nn.Module], save_projections: bool = False,
    cuda_graphs: bool = False,
) -> None:
    """Compile each block's forward; those in `checkpointed` with the checkpoint traced into the graph
    (keeping the outputs of narrowing projections with `save_projections`), their quantized layers told so
    (`QuantizedLinear.in_traced_checkpoint`) and then their LoRA layers, whose B factors may join the base's matmul
    (`LoRALinear.join_base`), replayed as CUDA graphs with `cuda_graphs` (parallel.cuda_graphs:
    `CUDA_GRAPH_OPTIONS`). A tiled MLP breaks its block's graph: the tiling runs eagerly, one tile's MLP in a graph
    of its own (parallel/tiling.py, compile_tiles)."""
    options = None
    if backend == "inductor":
        options = {**INDUCTOR_OPTIONS, **(CUDA_GRAPH_OPTIONS if cuda_graphs else {})}
    keep_graphs_cacheable(graph_safe_rng=cuda_graphs)
    if checkpointed:
        quiet_traced_checkpoint_notice()
        trace_checkpoints_through_restored_state()
    chosen = {id(b) for b in checkpointed}
    for block in blocks:
        forward = block.forward
        if id(block) in chosen:
            forward = traced_checkpoint(forward, save_projections)
            for module in block.modules():
                if isinstance(module, QuantizedLinear):
                    module.in_traced_checkpoint()
            for module in block.modules():  # once their bases were told
                if isinstance(module, LoRALinear):
                    module.join_base()
        block.forward = torch.compile(forward, backend=backend, options=options)
    compile_tiles(blocks, backend, options)
    first_block_shares_the_graph(blocks)


def check_cuda_graphs(parallel: ParallelConfig, device: torch.device, traced: int, checkpointed: int) -> None:
    """parallel.cuda_graphs where this run cannot replay its blocks as CUDA graphs: one error at build time, once the
    device, the compile decision and the world size are known (the config refuses what it can before)."""
    if device.type != "cuda":
        raise QShardError(f"parallel.cuda_graphs: needs a CUDA device; this run computes on {device.type}")
    if parallel.offloads_activations():  # the config refuses both given; this holds for what was settled after it
        raise QShardError("parallel.cuda_graphs: not with parallel.activation_offload (its copies of the saved "
                          "tensors could race the next graph replay)")
    if not parallel.compile:
        raise QShardError("parallel.cuda_graphs: parallel.compile auto did not compile the blocks here (see the log "
                          "line above); set parallel.compile true, or leave cuda_graphs off")
    if not checkpointed or traced < checkpointed:
        raise QShardError(f"parallel.cuda_graphs: needs every checkpointed block checkpointed inside its compiled "
                          f"graph; here {traced} of {checkpointed} are: only blocks used in place on one device are "
                          "(not blocks in FSDP2 units, as with more than one process; the log line on blocks used in "
                          "place says which); set parallel.cuda_graphs false to run without it")


def step_marker(parallel: ParallelConfig) -> Callable[[], None]:
    """What each optimizer step and evaluation calls first: under parallel.cuda_graphs, torch's mark that a step
    begins (the outputs of the last step's graph replays may be overwritten from then on, and no later); otherwise
    nothing."""
    return torch.compiler.cudagraph_mark_step_begin if parallel.replays_graphs() else _nothing


def _nothing() -> None:
    pass


def first_block_shares_the_graph(blocks: list[nn.Module]) -> None:
    """Let the first block run the compiled graph of the blocks after it: in training, its input is made to
    require grad like theirs (`_hidden_states_require_grad`). Only where it trains weights: a block that
    trains none would otherwise compute a whole backward for nothing."""
    if blocks and any(p.requires_grad for p in blocks[0].parameters()):
        # Prepended: a checkpoint's hook on the block must see the input that the forward gets.
        blocks[0].register_forward_pre_hook(_hidden_states_require_grad, prepend=True, with_kwargs=True)


class _DroppedGradient(torch.autograd.Function):
    """`x` recorded in autograd as if computed from `anchor`: it requires grad, and the gradient that reaches it
    goes no further (`x` comes from no trained weight). Returned detached, not as a view: with dynamic shapes
    the compiled graphs guard on a view's base, which the later blocks' inputs do not have."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


def _hidden_states_require_grad(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the first block: in training its hidden states require grad, as every later block's
    do. Blocks of a class share one compiled graph only if their inputs agree on requires_grad (a graph for an
    input that does not computes no gradient for it), and the first block's input comes from the embedding,
    which is frozen under LoRA: without this the first block would compile a second graph of its own. The
    cost: the first block's backward also computes its input's gradient (through its attention projections, a
    small part of one block's backward), which stops there: the frozen embedding computes no backward, and no
    tensor keeps the gradient (a leaf made to require grad would, in its .grad, until the graph is freed)."""
    if not torch.is_grad_enabled():
        return None
    in_args = bool(args)
    hidden = args[0] if in_args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.requires_grad:
        return None
    hidden = _DroppedGradient.apply(hidden, torch.empty(0, requires_grad=True))
    return ((hidden, *args[1:]), kwargs) if in_args else (args, {**kwargs, "hidden_states": hidden})


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_traced_checkpoint_notice() -> None:
    """torch warns, at the first compile, that a checkpoint given a context_fn (traced_checkpoint's policy)
    must hold no in-place ops; the blocks hold none (tests/test_fast_paths.py compares them with eager blocks),
    so users are not shown it. Other warnings of that logger still are."""
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage("Detected that context_fn is passed to torch.utils.checkpoint"))


def trace_checkpoints_through_restored_state() -> None:
    """Let the compiler trace a checkpointed block whose forward sets outside state and restores it before
    returning. transformers (5.25 on) runs attention through the `kernels` package, whose wrapper sets a context
    variable around each attention forward and resets it after; inside a traced checkpoint torch refuses any such
    write (a recompute would not replay it) and runs the whole checkpoint uncompiled, slowly and without saying so.
    The write is undone within the forward, so the recompute needs no replay of it. The setting is torch's, for
    the whole process: a checkpointed forward elsewhere in it with a lasting side effect would have that effect
    once, not again in its recompute (qshard's blocks have none; hooks run outside their compiled forward)."""
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def keep_graphs_cacheable(graph_safe_rng: bool = False) -> None:
    """Let torch's caches keep the blocks' compiled graphs, so that a later run loads them rather than compiles
    them again. Two settings of torch's stand in the way, each safe for qshard's blocks:
    - A block's graph holds random ops even without dropout (the attention kernel takes a dropout
      probability), which a traced checkpoint that recomputes attention (without kept projections) replays with
      their random state. Where torch cannot cache the wrapper it uses for that by default (the one CUDA graphs
      need), use the other, which it can; not under parallel.cuda_graphs (`graph_safe_rng`), whose graphs need the
      default: blocks that recompute attention then compile again in each run.
    - The graph of the autograd pass (AOTAutograd's cache, above inductor's) is cached only without custom
      autograd functions unless allowed. qshard's quantized matmuls are such functions; the compiler traces
      their forward and backward into the graph, which is what the cache is keyed on, and they keep no state
      beyond it (a layer's tensors are graph inputs), so their graphs are safe to reuse."""
    if not _graph_safe_rng_cacheable():
        torch._functorch.config.graphsafe_rng_functionalization = graph_safe_rng
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True


def compile_choice(parallel: ParallelConfig, device: torch.device, triton: bool | None = None) -> tuple[bool, str]:
    """Whether this run compiles its blocks, and why. `auto` compiles on CUDA where inductor can generate its
    kernels (Triton installed), and not where a setting keeps compile from paying: on the CPU inductor's C++
    kernels compile for minutes to beat eager by little, and reentrant checkpointing would be traced into the
    graph, which then keeps every activation (the config refuses `compile: true` with it). Tiled MLPs compile
    tile by tile (parallel/tiling.py, compile_tiles)."""
    if parallel.compile != AUTO:  # == not is: a value read from YAML is another str object
        return parallel.compile, f"parallel.compile {str(parallel.compile).lower()}"
    if device.type != "cuda":
        return False, f"parallel.compile auto: off on {device.type}"
    if triton is None:  # as installed here; `qshard plan` assumes the GPU machine has it
        triton = importlib.util.find_spec("triton") is not None
    if parallel.compile_backend == "inductor" and not triton:
        return False, "parallel.compile auto: off, Triton is not installed"
    if parallel.activation_checkpointing and parallel.ac_reentrant:
        return False, "parallel.compile auto: off with parallel.ac_reentrant true"
    return True, "parallel.compile auto: on (CUDA, Triton)"


def with_compile_decided(cfg: Config, compiled: bool) -> Config:
    """`cfg` with parallel.compile set to what `compile_choice` decided (the run's config.yaml keeps `auto`)."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, compile=compiled))


def decide_compile(cfg: Config, device: torch.device, log_it: bool) -> Config:
    """`cfg` with parallel.compile decided for `device`, said once in the log when it was `auto`, with where the
    compiled code is cached (`use_persistent_caches`; `qshard train` chooses that before anything imports
    inductor)."""
    compiled, why = compile_choice(cfg.parallel, device)
    if compiled and cfg.parallel.compile_backend == "inductor":
        why += f"; compiled code cached in {use_persistent_caches()}"
    if log_it and cfg.parallel.compile == AUTO:
        log.info(why)
    return with_compile_decided(cfg, compiled)


def cuda_graphs_choice(cfg: Config, device: torch.device, world_size: int, lengths: Callable[[], np.ndarray],
                       micro_batches: int | None, traced: Callable[[], bool] | None = None,
                       triton: bool | None = None) -> tuple[bool, str]:
    """Whether this run replays its compiled blocks as CUDA graphs, and why: `auto` where they can (compiled on this
    device, checkpointed inside their graphs: Config.cuda_graphs_unmet, then `traced()`, which asks the model, when
    given) and pay: the training rows (`lengths()`, tokens each) nearly fill data.max_length, which every
    micro-batch is padded to, a micro-batch is short, and the run's `micro_batches` left (None: not known, not
    considered) repay the start-up (`GRAPH_ROWS_FILLED`, `GRAPH_MAX_TOKENS`, `graph_min_micro_batches`). The costly
    questions, `lengths` and `traced`, are asked last."""
    p = cfg.parallel
    if p.cuda_graphs != AUTO:
        return p.cuda_graphs, f"parallel.cuda_graphs {str(p.cuda_graphs).lower()}"
    compiled, _ = compile_choice(p, device, triton)
    unmet = ([] if compiled else ["the blocks are not compiled here"]) + cfg.cuda_graphs_unmet(world_size)
    if device.type != "cuda":
        unmet.insert(0, f"computes on {device.type}")
    if unmet:
        return False, f"parallel.cuda_graphs auto: off, {unmet[0]}"
    tokens = cfg.data.max_length * cfg.train.micro_batch_size
    if tokens > GRAPH_MAX_TOKENS:
        return False, (f"parallel.cuda_graphs auto: off, a micro-batch of {tokens:,} tokens (data.max_length x "
                       f"train.micro_batch_size) launches its kernels faster than they run")
    least = graph_min_micro_batches(p)
    if micro_batches is not None and micro_batches < least:
        again = ", as the blocks would compile again in each run" if least == GRAPH_MIN_MICRO_BATCHES_RECOMPILED else ""
        return False, (f"parallel.cuda_graphs auto: off, the run's {micro_batches:,} micro-batches would not repay "
                       f"the graphs' start-up (seconds; from {least:,} they do{again})")
    rows = lengths()
    filled = float(rows.mean()) / cfg.data.max_length if len(rows) else 0.0
    if filled < GRAPH_ROWS_FILLED:
        return False, (f"parallel.cuda_graphs auto: off, the training rows fill {filled:.0%} of data.max_length "
                       f"({cfg.data.max_length:,}) on average, which each would be padded to (data.packing fills them)")
    if traced is not None and not traced():
        return False, ("parallel.cuda_graphs auto: off, not every checkpointed block is checkpointed inside its "
                       "compiled graph (a block with weights trained in full keeps its FSDP2 unit)")
    return True, (f"parallel.cuda_graphs auto: on, blocks replayed as CUDA graphs (rows {filled:.0%} full, padded to "
                  f"data.max_length {cfg.data.max_length:,})")


def graph_min_micro_batches(p: ParallelConfig) -> int:
    """The fewest micro-batches a run needs for CUDA graphs to repay their start-up: more where the blocks' graphs
    would be compiled again in each run, which they are where torch cannot cache graph-safe random state and a
    block's backward recomputes a random op (attention is one: it takes a dropout probability). Kept projections
    (`ac_save_projections`, settled by then) keep attention's outputs, so nothing random is recomputed."""
    if p.saves_projections() or _graph_safe_rng_cacheable():
        return GRAPH_MIN_MICRO_BATCHES
    return GRAPH_MIN_MICRO_BATCHES_RECOMPILED


def _graph_safe_rng_cacheable() -> bool:
    from torch._prims import rng_prims

    graphsafe = getattr(rng_prims, "graphsafe_run_with_rng_state", None)
    return graphsafe is None or graphsafe.cacheable()


def decide_cuda_graphs(cfg: Config, device: torch.device, world_size: int, lengths: Callable[[], np.ndarray],
                       micro_batches: int, traced: Callable[[], bool] | None, log_it: bool,
                       triton: bool | None = None) -> None:
    """Settle parallel.cuda_graphs in `cfg` (`cuda_graphs_choice`), before the model and the trainer are built from
    it, so that both, and the run's config.yaml, say what ran; said once in the log when it was `auto`."""
    on, why = cuda_graphs_choice(cfg, device, world_size, lengths, micro_batches, traced, triton)
    # Not where the blocks are not compiled: parallel.compile's own line says so.
    if log_it and cfg.parallel.cuda_graphs == AUTO and cfg.parallel.compile is not False and device.type == "cuda":
        log.info(why)
    cfg.parallel.cuda_graphs = on
