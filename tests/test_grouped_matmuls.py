"""The adapters' A factors of layers that read one input, computed as one matmul in compiled blocks
(parallel/grouped_matmuls.py): which linears the pass groups, and that a model trains as without it."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from conftest import nonzero_lora_b
from torch._dynamo.backends.debugging import aot_eager

from qshard.build import build_model
from qshard.config import Config
from qshard.parallel.compile import INDUCTOR_OPTIONS
from qshard.parallel.grouped_matmuls import GroupSharedInputLinears, group_shared_input_linears


class _Grouping:
    """A compiler backend that runs the pass on every graph dynamo hands it (a checkpoint's body included), as
    inductor runs its pre-grad pass, then aot_eager: the pass's effect on CPU, without generating code."""

    def __init__(self, group: bool) -> None:
        self.group, self.made = group, []

    def __call__(self, gm: fx.GraphModule, inputs):
        if self.group:
            for module in gm.modules():
                if isinstance(module, fx.GraphModule):
                    self.made.append(group_shared_input_linears(module.graph))
                    module.graph.lint()  # every node after its inputs (inductor would sort them; aot_eager does not)
                    module.recompile()
        return aot_eager(gm, inputs)


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        shapes = {"a1": (4, 32), "a2": (6, 32), "a3": (4, 32), "a4": (4, 32), "a5": (4, 32), "biased": (4, 32),
                  "wide": (32, 32), "c1": (1, 4), "c2": (1, 4), "m1": (4, 32), "m2": (4, 32)}
        for name, shape in shapes.items():  # m1, m2 frozen: backward would read the input that m2's mutates
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=g), requires_grad=name[0] != "m"))
        self.bias = nn.Parameter(torch.randn(4, generator=g))

    def forward(self, x, y):
        cast = x.dtype
        h = F.linear(x, self.a1.to(cast))
        out = [h, F.linear(x, self.wide.to(cast)), F.linear(x, self.biased.to(cast), self.bias),
               F.linear(x, self.a3, None), F.linear(x, self.a4), F.linear(y, self.a5.to(cast)),
               F.linear(x, self.a2.to(cast)) * 2]
        with torch.no_grad():  # not grouped with the linears above: its output must not require grad
            out.append(F.linear(x, self.a5.to(cast)))
        out.append(F.linear(x, self.a5.to(cast)))  # grad mode on again: grouped with a1's and a2's
        z = x * 1
        out.append(F.linear(z, self.m1.to(cast)))
        z.add_(1)  # not grouped across an in-place op
        out.append(F.linear(z, self.m2.to(cast)))
        return (*out, F.linear(h, self.c1.to(cast)), F.linear(h, self.c2.to(cast)))  # a1's output, a second group


def test_only_adapter_linears_of_one_input_are_grouped():
    """The narrow, cast, unbiased linears that read x with gradients become one matmul (the later ones' casts moved up
    to the first, across a no_grad region), and the two that read a member of that group become a second; a wide
    weight, a bias (or `None` passed for it), an uncast weight, another input, a linear under no_grad and linears
    apart from an in-place op between them are left alone. The outputs and their requires_grad are eager's."""
    torch._dynamo.reset()
    layers, backend = _Layers(), _Grouping(group=True)
    x, y = torch.randn(3, 32), torch.randn(3, 32)
    expected = layers(x, y)
    try:
        compiled = torch.compile(layers, backend=backend)(x, y)
    finally:
        torch._dynamo.reset()
    assert backend.made == [2]
    for got, want in zip(compiled, expected, strict=True):
        torch.testing.assert_close(got, want)
        assert got.requires_grad == want.requires_grad
    graph = []

    def capture(gm, inputs):
        group_shared_input_linears(gm.graph)
        graph.extend(n for n in gm.graph.nodes if n.target in (torch.cat, torch.split))
        return gm

    try:
        torch.compile(layers, backend=capture)(x, y)
    finally:
        torch._dynamo.reset()
    sizes = sorted(n.args[1] for n in graph if n.target is torch.split)
    assert sizes == [[1, 1], [4, 6, 4]], sizes  # c1, c2; a1, a2 and the a5 after the no_grad region


def _setitem(x, a, b, dt):
    h = x * 1
    p = F.linear(h, a.to(dt))
    h[0] = 0
    return p, F.linear(h, b.to(dt))


def _relu_in_place(x, a, b, dt):
    h = x * 1
    p = F.linear(h, a.to(dt))
    F.relu(h, inplace=True)
    return p, F.linear(h, b.to(dt))


def _weight_written_after_its_cast(x, a, b, dt):
    w = b.to(dt)
    with torch.no_grad():
        b.mul_(0)
    return F.linear(x, a.to(dt)), F.linear(x, w)


def _cast_to_a_later_tensor(x, a, b, dt):
    p = F.linear(x, a.to(dt))
    t = x.sum() * 0 + 1
    return p, F.linear(x, b.to(t))


def _linear_under_no_grad(x, a, b, dt):
    w = b.to(dt)
    p = F.linear(x, a.to(dt))
    with torch.no_grad():
        return p, F.linear(x, w)


def _output_written(x, a, b, dt):
    p, q = F.linear(x, a.to(dt)), F.linear(x, b.to(dt))
    return p, q.mul_(2)


# Which of x, a and b require grad: none where backward would read a tensor the hazard writes into.
@pytest.mark.parametrize(("hazard", "needs_grad"), [
    (_setitem, ()), (_relu_in_place, ()), (_weight_written_after_its_cast, ()), (_cast_to_a_later_tensor, "ab"),
    (_linear_under_no_grad, "b"), (_output_written, "ab")])
def test_linears_a_write_or_grad_mode_sets_apart_are_not_grouped(hazard, needs_grad):
    """Two adapter-like linears of one input that the pass would group but for a write into a tensor between them (or
    into the output it would split), a cast reading a tensor made after the first, or the second run under no_grad
    with an input that needs gradients: left as they are, and computing what eager computes."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=g, dtype=torch.float64)
    a, b = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
    x, a, b = (t.requires_grad_(name in needs_grad) for name, t in zip("xab", (x, a, b), strict=True))
    backend = _Grouping(group=True)
    expected = hazard(x, a.detach().clone().requires_grad_(a.requires_grad),
                      b.detach().clone().requires_grad_(b.requires_grad), torch.float64)
    try:
        got = torch.compile(hazard, backend=backend)(x, a, b, torch.float64)
    finally:
        torch._dynamo.reset()
    assert backend.made and not any(backend.made), backend.made
    for g_, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g_, e)
        assert g_.requires_grad == e.requires_grad


_COMPILE = torch.compile


def _tiny(dist_env, model_dir, train_type: str, backend: _Grouping, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, backend=None, options=None, _b=backend: _COMPILE(fn, backend=_b))
    cfg = Config()
    cfg.train.train_type, cfg.train.precision, cfg.lora.rank = train_type, "fp32", 8
    cfg.parallel.compile, cfg.parallel.compile_backend, cfg.parallel.ac_save_projections = True, "aot_eager", True
    torch.manual_seed(0)
    model, _ = build_model(cfg.validate(), dist_env, model_dir)
    model.train()
    nonzero_lora_b(model)
    return model


def _loss_and_saved_elements(model, batch) -> tuple[torch.Tensor, int]:
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
        loss = model(**batch, use_cache=False).logits.square().mean()
    return loss, sum(kept)


@pytest.mark.parametrize("train_type", ["qlora", "qdora"])
def test_blocks_with_grouped_factors_train_like_blocks_without(dist_env, tiny_models, monkeypatch, train_type):
    """A tiny Llama's compiled blocks (checkpointed inside their graph, projections kept): with the pass, each block's
    graph has two groups (q/k/v's A factors, gate/up's), keeps as many bytes for backward, and computes the same loss
    and gradients."""
    model_dir = tiny_models("llama", hidden_size=256, intermediate_size=1024)
    batch = {"input_ids": torch.randint(3, 200, (1, 64), generator=torch.Generator().manual_seed(0))}
    results = {}
    for group in (False, True):
        backend = _Grouping(group)
        try:
            model = _tiny(dist_env, model_dir, train_type, backend, monkeypatch)
            loss, kept = _loss_and_saved_elements(model, batch)
            loss.backward()
        finally:
            torch._dynamo.reset()
        results[group] = (backend.made, loss.item(), kept,
                          {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    made, loss, kept, grads = results[True]
    assert sum(made) == 2, made  # one graph for both blocks
    assert loss == pytest.approx(results[False][1], rel=1e-5)
    assert kept == results[False][2]
    assert grads.keys() == results[False][3].keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        want = results[False][3][name]  # fp32, summed in another order
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-4 * want.abs().max().item(), msg=name)


def test_inductor_runs_the_pass_and_its_caches_can_key_it():
    """Compiled blocks hand inductor the pass; it names itself by this file's contents, which torch's caches need to
    keep the graphs it changes."""
    chosen = INDUCTOR_OPTIONS["pre_grad_custom_pass"]
    assert isinstance(chosen, GroupSharedInputLinears)
    assert chosen.uuid() == GroupSharedInputLinears().uuid() and chosen.uuid().startswith("qshard-grouped-matmuls-")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor generates code on a GPU")
def test_inductor_groups_the_factors_inside_a_traced_checkpoint(dist_env, tiny_models, caplog):
    """On a GPU, inductor (not the CPU stand-in above) runs the pass on the checkpoint's body: two groups a block
    graph, one graph for both blocks."""
    cfg = Config()
    cfg.lora.rank = 8
    cfg.parallel.compile, cfg.parallel.compile_backend = True, "inductor"
    model, _ = build_model(cfg.validate(), dist_env, tiny_models("llama", hidden_size=256, intermediate_size=1024))
    model.train()
    try:  # with torch's caches a graph compiled before (an earlier run) would be loaded, the pass not run
        with caplog.at_level("DEBUG", logger="qshard"), torch._inductor.config.patch(force_disable_caches=True):
            model(input_ids=torch.randint(3, 200, (1, 64), device="cuda"), use_cache=False).logits.sum().backward()
    finally:
        torch._dynamo.reset()
    grouped = [r.getMessage() for r in caplog.records if "grouped into one matmul" in r.getMessage()]
    assert grouped == ["adapter A factors of 2 shared inputs grouped into one matmul each"], grouped
