"""One matmul for the adapters' A factors of layers that read the same input.

In a Llama block q_proj, k_proj and v_proj read one normalized input, and so do gate_proj and up_proj. Their LoRA
(and DoRA) adapters each multiply that input by their own narrow A factor ([rank, in]): five small matmuls a block in
forward, and in backward five more for A's gradients and five for the input's, each too small to fill the GPU, so the
step waits on their launches. Concatenating the A factors of one input ([3 * rank, in]) makes each of these one
matmul; the price is a split of its output and, in backward, a concatenation of the gradients ([tokens, 3 * rank]).

Done on the compiled graph, before autograd is traced (inductor's pre-grad pass), so the model, its parameters and its
checkpoints stay as they are: only the compiled code changes. What is grouped is what an adapter computes: a linear
without bias whose weight is a parameter cast to the compute dtype (`LoRALinear.forward`, `DoRALinear.forward`) and
at most half as wide as its input. Base layers are not: a dense one passes its weight uncast (and a bias argument),
a quantized one a dequantized weight, and concatenating full weights would copy them at every step. Nothing is
grouped with LoRA dropout, where each adapter reads its own dropout's output.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
from pathlib import Path

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

log = logging.getLogger("qshard")

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
                       operator.ilshift, operator.irshift, operator.setitem)


def _example(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _mutates(node: fx.Node) -> bool:
    """Whether `node` may write into a tensor, which could change a later linear's input or weight: a method or
    function named with a trailing underscore, `x += y`, `x[i] = y`, an op whose schema mutates, `inplace=True`, an
    `out=` argument, a module call. Conservative: Python's `operator.and_` and its like are pure, the rest is judged by
    those signs."""
    if node.op == "call_module":
        return True
    if node.op not in ("call_method", "call_function"):
        return False
    if node.kwargs.get("inplace") or "out" in node.kwargs:
        return True
    if node.op == "call_method":
        name = node.target
        if name == "__setitem__" or name.startswith("__i"):
            return True
    else:
        target = node.target
        if target in _IN_PLACE_OPERATORS:
            return True
        if isinstance(target, torch._ops.OpOverloadPacket):
            return any(getattr(target, o)._schema.is_mutable for o in target.overloads())
        if isinstance(target, torch._ops.OpOverload):
            return target._schema.is_mutable
        if getattr(target, "__module__", None) in ("_operator", "operator"):
            return False
        name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _adapter_factor(node: fx.Node) -> torch.Tensor | None:
    """The weight of `node` if it computes an adapter's low-rank input: a linear of two arguments (no bias) whose
    weight is a graph input (a parameter) cast by `.to` (of nothing else from the graph), with static dimensions and
    at most half as many rows as columns; under the grad mode of its cast; its output not modified in place (the split
    that replaces it returns views autograd would refuse to let change). Else None."""
    if node.op != "call_function" or node.target not in _LINEAR or len(node.args) != 2 or node.kwargs:
        return None
    x, weight = node.args
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node):
        return None
    if weight.op != "call_method" or weight.target != "to" or len(weight.users) != 1:
        return None
    sources = weight.all_input_nodes
    if sources[:1] != [weight.args[0]] or any(n.op != "placeholder" for n in sources):
        return None
    value, parameter, inputs, output = _example(weight), _example(sources[0]), _example(x), _example(node)
    if any(t is None for t in (value, parameter, inputs, output)):
        return None
    if value.dim() != 2 or not all(isinstance(d, int) for d in value.shape):
        return None
    # A cast or linear run under no_grad, with inputs that need gradients: grouped, it would pass them.
    if value.requires_grad != parameter.requires_grad or output.requires_grad != (inputs.requires_grad or
                                                                                  value.requires_grad):
        return None
    if any(_mutates(user) for user in node.users):
        return None
    return value if 2 * value.shape[0] <= value.shape[1] else None


def _groups(graph: fx.Graph) -> list[list[tuple[fx.Node, torch.Tensor]]]:
    """The adapter linears of `graph` that may become one, in graph order, at least two a group: the same input, the
    same weight dtype and device, outputs of one dtype (one autocast state) and alike in requires_grad, and no write
    into any tensor between them and their casts (`_mutates`)."""
    found: dict[tuple, list[tuple[fx.Node, torch.Tensor]]] = {}
    writes, writes_before = 0, {}
    for node in graph.nodes:
        if _mutates(node):
            writes += 1
            continue
        writes_before[node] = writes
        weight = _adapter_factor(node)
        if weight is not None and writes_before[node.args[1]] == writes:
            output = _example(node)
            key = (node.args[0], weight.dtype, weight.device, output.dtype, output.requires_grad, writes)
            found.setdefault(key, []).append((node, weight))
    return [members for members in found.values() if len(members) > 1]


def _group(graph: fx.Graph, members: list[tuple[fx.Node, torch.Tensor]]) -> bool:
    """Replace `members` by one linear over their concatenated weights and a split, at the first one's place; the casts
    of later ones that come after it move up there (a cast reads only a graph input, and no write lies between it and
    the first linear: `_groups`). False where together they are wider than half their input: stricter than the
    traced checkpoint's rule for a narrowing matmul (parallel/checkpointing.py), so the fused output is kept for
    backward under `ac_save_projections` as its members' were."""
    if 2 * sum(weight.shape[0] for _, weight in members) > members[0][1].shape[1]:
        return False
    first = members[0][0]
    x = first.args[0]
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node, _ in members[1:]:
        if order[node.args[1]] > order[first]:
            first.prepend(node.args[1])
    with graph.inserting_before(first):
        weight = graph.call_function(torch.cat, ([node.args[1] for node, _ in members],), {"dim": 0})
        fused = graph.call_function(torch._C._nn.linear, (x, weight))
        parts = graph.call_function(torch.split, (fused, [w.shape[0] for _, w in members]), {"dim": -1})
        for i, (node, _) in enumerate(members):
            node.replace_all_uses_with(graph.call_function(operator.getitem, (parts, i)))
    for node, _ in members:
        graph.erase_node(node)
    return True


def group_shared_input_linears(graph: fx.Graph) -> int:
    """Replace the adapter linears of `graph` that share an input (`_adapter_factor`) by one linear of their
    concatenated weights and a split. Returns how many groups were made."""
    made = 0
    for members in _groups(graph):
        made += _group(graph, members)
    return made


@functools.cache
def _source_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


class GroupSharedInputLinears(CustomGraphPass):
    """`group_shared_input_linears` as inductor's pre-grad pass. Its `uuid` (this file's hash) lets torch's caches keep
    the graphs it changed, and compile anew when the pass changes."""

    def __call__(self, graph: fx.Graph) -> None:
        made = group_shared_input_linears(graph)
        if made:
            log.debug("adapter A factors of %d shared inputs grouped into one matmul each", made)

    def uuid(self) -> str:
        return "qshard-grouped-matmuls-" + _source_hash()
