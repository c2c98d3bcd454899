"""Compiled blocks: one graph per block class, and graphs that torch's caches can keep (parallel/compile.py)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

from qshard.build import build_model
from qshard.config import Config


def _tiny_qlora(dist_env, model_dir, compiled: bool, **parallel):
    cfg = Config()
    cfg.lora.rank = 8
    cfg.train.precision = "fp32"
    cfg.parallel.compile = compiled
    for name, value in parallel.items():
        setattr(cfg.parallel, name, value)
    if compiled:
        cfg.parallel.compile_backend = "aot_eager"
    torch.manual_seed(0)
    model, _ = build_model(cfg.validate(), dist_env, model_dir)
    model.train()
    with torch.no_grad():  # B starts at zero, which would hide A's gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                local = p.to_local() if isinstance(p, DTensor) else p  # FSDP2's shard (the whole, on one rank)
                local.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
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
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-5, atol=1e-7, msg=name)


def test_blocks_with_offloaded_storage_share_one_graph_and_train_like_eager(dist_env, tiny_models):
    """parallel.cpu_offload with quant_sharding dtensor: a compiled block reads its layers' host shards as graph
    inputs, so the three blocks share one graph (no guard on which block the shards belong to, which would
    compile a graph per block and, past torch's recompile limit, leave the rest eager); loss and gradients are
    the eager offloaded blocks'."""
    model_dir = tiny_models("llama", num_hidden_layers=3)
    batch = {"input_ids": torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))}
    grads, losses = {}, {}
    for compiled in (False, True):
        model = _tiny_qlora(dist_env, model_dir, compiled, quant_sharding="dtensor", cpu_offload=True)
        assert all(layer.offloaded is not None for layer in model.modules() if hasattr(layer, "STORAGE"))
        torch._dynamo.reset()
        counters.clear()
        try:
            loss = model(**batch, use_cache=False).logits.float().square().mean()
            loss.backward()
            if compiled:
                assert dict(counters["stats"])["unique_graphs"] == 1, dict(counters["stats"])
                assert not torch._dynamo.utils.guard_failures, dict(torch._dynamo.utils.guard_failures)
        finally:
            torch._dynamo.reset()
        losses[compiled] = loss.detach()
        grads[compiled] = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[False].keys() == grads[True].keys() and len(grads[False]) == 3 * 14
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-6, atol=1e-6)
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-5, atol=1e-7, msg=name)
