"""Compiled blocks: one graph per block class, graphs that torch's caches can keep, and each NF4 weight dequantized once
a graph (parallel/compile.py)."""

from __future__ import annotations

import functools
import weakref
from collections import Counter

import torch
from conftest import nonzero_lora_b
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._inductor.decomposition import select_decomp_table

from qshard.build import build_model
from qshard.config import Config
from qshard.parallel import fsdp
from qshard.parallel.compile import compile_blocks
from qshard.quant import NF4Linear


def _tiny_qlora(dist_env, model_dir, compiled: bool, backend: str = "aot_eager", **parallel):
    """A tiny QLoRA model, its blocks compiled with `backend` where `compiled` (no code generated: aot_eager; with
    inductor's partitioner, which decides what backward recomputes: aot_eager_decomp_partition)."""
    cfg = Config()
    cfg.lora.rank = 8
    cfg.train.precision = "fp32"
    cfg.quant.double_quant = False  # two storage tensors a layer (codes, fp32 scales): the fetch counts below
    cfg.parallel.compile = compiled
    for name, value in parallel.items():
        setattr(cfg.parallel, name, value)
    if compiled:
        cfg.parallel.compile_backend = backend
    torch.manual_seed(0)
    model, _ = build_model(cfg.validate(), dist_env, model_dir)
    model.train()
    nonzero_lora_b(model)
    return model


def _leaves_outside(loss: torch.Tensor, params: set[int]) -> list[torch.Tensor]:
    """The tensors other than `params` that backward would accumulate a gradient into (and keep it)."""
    kept, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in params:
            kept.append(variable)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return kept


def test_every_block_runs_one_graph_that_the_caches_can_keep_and_trains_like_eager(dist_env, tiny_models):
    """Three blocks of one class compile one graph: the first block's input (from the frozen embedding) requires
    grad like the others', which the compiled graphs guard on. No tensor but the trained weights keeps a
    gradient for it. AOTAutograd's cache can key the graph (a miss, not a bypass: the traced checkpoint's policy
    is named by a cache_hash and pickles, and the quantized matmul's autograd function is allowed), and the
    loss and gradients are the eager blocks'. Another sequence length compiles one more graph (a dynamic one),
    again shared by every block."""
    model_dir = tiny_models("llama", num_hidden_layers=3)
    batch = {"input_ids": torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))}
    grads, losses = {}, {}
    for compiled in (False, True):
        model = _tiny_qlora(dist_env, model_dir, compiled)
        torch._dynamo.reset()
        counters.clear()
        try:
            # aot_eager generates no code; forcing the AOTAutograd cache on it still decides hit, miss or bypass.
            with torch._functorch.config.patch(force_autograd_cache=True):
                loss = model(**batch, use_cache=False).logits.float().square().mean()
            if compiled:
                assert dict(counters["stats"])["unique_graphs"] == 1, dict(counters["stats"])
                assert not torch._dynamo.utils.guard_failures, dict(torch._dynamo.utils.guard_failures)
                assert counters["aot_autograd"]["autograd_cache_bypass"] == 0, dict(counters["aot_autograd"])
                assert counters["aot_autograd"]["autograd_cache_miss"] == 1, dict(counters["aot_autograd"])
            leaves = _leaves_outside(loss, {id(p) for p in model.parameters()})
            loss.backward()
            assert [leaf.shape for leaf in leaves if leaf.grad is not None] == []
            losses[compiled] = loss.detach()
            grads[compiled] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            if compiled:  # another length: one more graph, with a dynamic sequence length, for every block again
                longer = {"input_ids": torch.randint(3, 200, (2, 32), generator=torch.Generator().manual_seed(0))}
                model(**longer, use_cache=False).logits.float().square().mean().backward()
                assert dict(counters["stats"])["unique_graphs"] == 2, dict(counters["stats"])
        finally:
            torch._dynamo.reset()
    assert grads[False].keys() == grads[True].keys() and len(grads[False]) == 3 * 14  # q,k,v,o,gate,up,down: A, B
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-6, atol=1e-6)
    # The compiled blocks' adapters join their B factors to the base's matmul (quant/nf4.py, fp32 sums in another
    # order): A's gradients, through three blocks, move by up to about 1.3e-5 of their largest (the same model in
    # fp64, its weights dequantized in plain torch, agreed to 3e-15).
    for name in grads[False]:
        scale = grads[False][name].abs().max().item()
        torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-5, atol=1e-4 * scale, msg=name)


def _nf4_lookups(graph: torch.fx.Graph) -> int:
    """How many NF4 dequantizations `graph` computes: its lookups in the 16-level table."""
    return sum(1 for n in graph.nodes if n.target is torch.ops.aten.index.Tensor
               and tuple(n.args[0].meta["val"].shape) == (16,))


def test_a_checkpointed_block_dequantizes_each_weight_once_in_backward(dist_env, tiny_models, monkeypatch):
    """In the backward graph of a block whose checkpoint is traced, the recomputed forward and the input gradient
    of each NF4 linear use the same dequantized weight: the graph dequantizes each weight once, as forward does
    (decomposed and partitioned as inductor does it, its code not generated)."""
    graphs = {}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm.graph
            return make_boxed_func(gm.forward)
        return compiler

    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           decompositions=select_decomp_table, partition_fn=partition)
    monkeypatch.setattr(fsdp, "compile_blocks", lambda blocks, _, *args: compile_blocks(blocks, backend, *args))
    model = _tiny_qlora(dist_env, tiny_models("llama", num_hidden_layers=1), True)
    linears = sum(isinstance(m, NF4Linear) for m in model.modules())
    torch._dynamo.reset()
    try:
        batch = {"input_ids": torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))}
        model(**batch, use_cache=False).logits.float().square().mean().backward()
    finally:
        torch._dynamo.reset()
    assert linears == 7 and graphs.keys() == {"forward", "backward"}
    assert _nf4_lookups(graphs["forward"]) == linears
    assert _nf4_lookups(graphs["backward"]) == linears


def _watch_fetches(model) -> tuple[list, list, object]:
    """What the offload window does from here on, recorded: each block it stages, with the direction of the pass
    (1 forward, -1 backward, None before any fetch) and how many blocks the window held staged at that moment
    (its old copy of the block dropped first), and each storage tensor a compiled graph fetches through
    `qshard::storage_to_device` (`StorageWindow.fetch_owned`), with the block, the direction, whether a backward
    graph asked, and a weak reference to what it got. Also the window (its `paths`)."""
    window = next(m.offloaded.window for m in model.modules() if getattr(m, "offloaded", None) is not None)
    staged, fetched = [], []
    stage, fetch_owned = window._stage, window.fetch_owned

    def recorded_stage(block: int):
        assert block not in window.staged and len(window.staged) <= 1, (block, list(window.staged))
        staged.append((block, window._position[1] if window._position else None))
        return stage(block)

    def recorded_fetch(block: int, index: int, which: int, backward: bool):
        got = fetch_owned(block, index, which, backward)
        fetched.append((block, window._position[1], backward, weakref.ref(got)))
        return got

    window._stage, window.fetch_owned = recorded_stage, recorded_fetch
    return staged, fetched, window


def _fetch_counts(fetched: list) -> dict:
    """(block, pass) -> storage tensors fetched: forward, recompute (forward graph in backward), backward graph."""
    passes = {(1, False): "forward", (-1, False): "recompute", (-1, True): "backward"}
    return dict(Counter((block, passes[direction, backward]) for block, direction, backward, _ in fetched))


def _offloaded_runs(dist_env, model_dir, backend: str = "aot_eager", **parallel) -> dict:
    """Eager and compiled blocks under cpu_offload with quant_sharding dtensor, two micro-batches' forward and
    backward each (gradients accumulated): losses, gradients, and in the compiled run the graphs compiled and what
    the offload window did. No fetch of the compiled run copies from host memory on the compute stream."""
    batch = {"input_ids": torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))}
    runs = {}
    for compiled in (False, True):
        model = _tiny_qlora(dist_env, model_dir, compiled, backend, quant_sharding="dtensor", cpu_offload=True,
                            **parallel)
        assert all(layer.offloaded is not None for layer in model.modules() if hasattr(layer, "STORAGE"))
        staged, fetched, window = _watch_fetches(model)
        torch._dynamo.reset()
        counters.clear()
        try:
            losses = []
            for micro_batch in range(2):
                with torch._functorch.config.patch(force_autograd_cache=True):
                    loss = model(**batch, use_cache=False).logits.float().square().mean()
                if micro_batch == 0:  # what forward fetched is gone before backward: nothing keeps a block's copy
                    kept = [block for block, _, _, got in fetched if got() is not None]
                loss.backward()
                losses.append(loss.detach())
            runs[compiled] = {
                "loss": torch.stack(losses), "staged": staged, "fetched": _fetch_counts(fetched), "kept": kept,
                "paths": dict(window.paths),
                "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None},
                "stats": dict(counters["stats"]), "guard_failures": dict(torch._dynamo.utils.guard_failures),
                "aot": dict(counters["aot_autograd"]),
            }
        finally:
            torch._dynamo.reset()
    eager, compiled = runs[False], runs[True]
    assert eager["fetched"] == {} and eager["paths"] == {}  # eager blocks fetch through StorageWindow.fetch
    assert compiled["paths"].get("host", 0) == 0, compiled["paths"]
    assert eager["grads"].keys() == compiled["grads"].keys() and len(eager["grads"]) == 3 * 14
    torch.testing.assert_close(compiled["loss"], eager["loss"], rtol=1e-6, atol=1e-6)
    # Decomposed ops (inductor's partitioner works on them) round differently, by a few parts in a million.
    rtol, atol = (1e-5, 1e-7) if backend == "aot_eager" else (1e-4, 1e-6)
    for name in eager["grads"]:
        torch.testing.assert_close(compiled["grads"][name], eager["grads"][name], rtol=rtol, atol=atol, msg=name)
    return compiled


def test_blocks_with_offloaded_storage_share_one_graph_and_train_like_eager(dist_env, tiny_models):
    """parallel.cpu_offload with quant_sharding dtensor: a compiled block reads its layers' host shards as graph
    inputs, so the three blocks share one graph (no guard on which block the shards belong to, which would
    compile a graph per block and, past torch's recompile limit, leave the rest eager); loss and gradients are
    the eager offloaded blocks'. The graph fetches the shards through the offload window (the operator
    qshard::storage_to_device), which prefetches the next block as for eager blocks: each block is staged once
    a pass, in the pass's order, and each of its 14 storage tensors (7 layers' codes and scales) is fetched once
    in forward, once in the checkpoint's recomputation and once in the backward graph; the cache can keep the
    graph with the operator in it."""
    compiled = _offloaded_runs(dist_env, tiny_models("llama", num_hidden_layers=3))
    assert compiled["stats"]["unique_graphs"] == 1, compiled["stats"]
    assert not compiled["guard_failures"], compiled["guard_failures"]
    assert compiled["aot"].get("autograd_cache_bypass", 0) == 0 and compiled["aot"]["autograd_cache_miss"] == 1, \
        compiled["aot"]
    # Never the last block again at the turn, nor block 0 at the next micro-batch's forward: the last block of a
    # pass hands its graphs copies, and the next pass starts from its staged copy.
    assert compiled["staged"] == [(0, 1), (1, 1), (2, 1), (1, -1), (0, -1)] + [(1, 1), (2, 1), (1, -1), (0, -1)]
    assert compiled["fetched"] == {(b, p): 28 for b in range(3) for p in ("forward", "recompute", "backward")}
    # Staged tensors handed out: blocks 0 and 1 forward, 2 and 1 backward; copies: the recomputation, and the
    # last block of each pass (2 forward, 0 backward).
    assert compiled["paths"] == {"staged": 2 * 56, "clone": 2 * 70}, compiled["paths"]


def test_offloaded_blocks_resident_or_not_checkpointed_fetch_only_what_they_need(dist_env, tiny_models):
    """parallel.resident_blocks 1 and ac_every 2: the resident block 0 fetches nothing; block 1, not
    checkpointed, fetches its storage in forward and again in its backward graph, and keeps none of it from one to
    the other (what its forward fetched is gone when forward ends); block 2, checkpointed, also in the
    recomputation. Compiled with inductor's partitioner, which would keep in forward the fetches a backward graph
    makes unless they depend on the backward pass. Streamed blocks share a graph (the resident block's shards are
    no operator's inputs, so it has one of its own), and loss and gradients are eager's."""
    compiled = _offloaded_runs(dist_env, tiny_models("llama", num_hidden_layers=3), "aot_eager_decomp_partition",
                               resident_blocks=1, ac_every=2)
    assert compiled["stats"]["unique_graphs"] == 2, compiled["stats"]
    assert compiled["kept"] == []
    assert compiled["fetched"] == {(1, "forward"): 28, (1, "backward"): 28,
                                   (2, "forward"): 28, (2, "recompute"): 28, (2, "backward"): 28}
    # Block 1 is prefetched by the resident block's forward hook before any fetch, kept from the backward (whose
    # last streamed block it is) for the next forward, and block 2 is never staged again at the turn.
    assert compiled["staged"] == [(1, None), (2, 1), (1, -1)] + [(2, 1), (1, -1)]
    assert compiled["paths"] == {"staged": 2 * 28, "clone": 2 * 42}, compiled["paths"]


def test_offloaded_qdora_blocks_fetch_each_tensor_once_a_pass(dist_env, tiny_models):
    """QDoRA asks for a layer's storage for its base matmul and for its weight's norm, and with adapter dropout
    for a second base matmul (in forward and backward): compiled offloaded blocks must not fetch any of these from
    host memory again on the compute stream, in training with dropout (two micro-batches) nor in an evaluation
    forward without gradients. Offloaded (one fetch for all three) and not, QDoRA computes the same losses and
    gradients, dropout included (eager blocks, same draws); compiled, the same evaluation loss."""
    model_dir = tiny_models("llama", num_hidden_layers=2)
    batch = {"input_ids": torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))}
    runs = {}
    for offloaded, compiled in ((False, False), (True, False), (True, True)):
        cfg = Config()
        cfg.lora.rank, cfg.lora.dropout = 8, 0.1
        cfg.train.train_type, cfg.train.precision = "qdora", "fp32"
        cfg.parallel.compile = compiled
        if compiled:
            cfg.parallel.compile_backend = "aot_eager"
        cfg.parallel.quant_sharding, cfg.parallel.cpu_offload = "dtensor", offloaded
        torch.manual_seed(0)
        model, _ = build_model(cfg.validate(), dist_env, model_dir)
        if offloaded:
            _, fetched, window = _watch_fetches(model)
        torch._dynamo.reset()
        try:
            model.train()
            losses = []
            for micro_batch in range(2):
                torch.manual_seed(1 + micro_batch)  # the same dropout draws in every run
                loss = model(**batch, use_cache=False).logits.float().square().mean()
                loss.backward()
                losses.append(loss.detach())
            model.eval()
            with torch.no_grad():
                evaluated = model(**batch, use_cache=False).logits.float().square().mean()
            runs[offloaded, compiled] = {"losses": torch.stack(losses), "eval": evaluated, "grads": {
                n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}}
        finally:
            torch._dynamo.reset()
    assert fetched and window.paths.get("host", 0) == 0, window.paths
    plain, eager, compiled = runs[False, False], runs[True, False], runs[True, True]
    # A, B and the magnitude of q, k, v, o, gate, up and down (block 0's, at least).
    assert len(plain["grads"]) >= 7 * 3 and eager["grads"].keys() == plain["grads"].keys()
    torch.testing.assert_close(eager["losses"], plain["losses"], rtol=1e-6, atol=1e-6)
    for name in plain["grads"]:
        torch.testing.assert_close(eager["grads"][name], plain["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
    for run in (eager, compiled):
        torch.testing.assert_close(run["eval"], plain["eval"], rtol=1e-6, atol=1e-6)


class _ScopedRegistry:
    """Outside state a forward sets and restores, shaped like the `kernels` package's (a dependency of transformers
    from 5.25 on) around each attention forward: a global value the compiler sees written, holding modules and
    functions (not constants, whose restored writes torch checks by value and lets pass)."""

    def __init__(self) -> None:
        self.value = None

    def set(self, value):
        previous, self.value = self.value, value
        return previous

    def reset(self, previous) -> None:
        self.value = previous


_REGISTRY = _ScopedRegistry()


class _BlockWithScopedState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        previous = _REGISTRY.set({"linear": (self.linear, type(self.linear).forward)})
        try:
            return x + self.linear(x).relu()
        finally:
            _REGISTRY.reset(previous)


def test_a_traced_checkpoint_compiles_a_forward_that_sets_and_restores_outside_state():
    """A block whose forward sets outside state and restores it (as transformers' attention does through the
    `kernels` package) still runs one compiled graph with its checkpoint traced inside: torch refuses such a write
    in a checkpoint unless told the recompute need not replay it (compile.py, trace_checkpoints_through_restored_state),
    and would otherwise run the checkpoint uncompiled. Gradients as eager blocks'; the state restored."""
    torch.manual_seed(0)
    eager = [_BlockWithScopedState() for _ in range(2)]
    compiled = [_BlockWithScopedState() for _ in range(2)]
    for a, b in zip(eager, compiled):
        b.load_state_dict(a.state_dict())
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    counters.clear()
    try:
        compile_blocks(compiled, "aot_eager", compiled)
        for blocks in (eager, compiled):
            blocks[1](blocks[0](x.clone().requires_grad_())).square().sum().backward()
        breaks, graphs = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert not breaks and graphs == 1, (breaks, graphs)
    assert _REGISTRY.value is None
    for a, b in zip(eager, compiled):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=name)
