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
a quantized one a dequantized weight, and concatenating full weights would copy them at every step.
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
                       operator.ilshift, operator.irshift)


def _example(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _in_place(node: fx.Node) -> bool:
    """An in-place op (a tensor method or torch function named with a trailing underscore, `x += y`): it could
    change a later linear's input or weight. Python's `operator.and_` and its like are not in place."""
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        if node.target in _IN_PLACE_OPERATORS:
            return True
        if getattr(node.target, "__module__", None) in ("_operator", "operator"):
            return False
        name = getattr(node.target, "__name__", "")
    else:
        return False
    return name.endswith("_") and not name.endswith("__")


def _adapter_factor(node: fx.Node) -> torch.Tensor | None:
    """The weight of `node` if it computes an adapter's low-rank input: a linear of two arguments (no bias) whose
    weight is a graph input (a parameter) cast by `.to`, with static dimensions and at most half as many rows
    as columns. Else None."""
    if node.op != "call_function" or node.target not in _LINEAR or len(node.args) != 2 or node.kwargs:
        return None
    x, weight = node.args
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node):
        return None
    if weight.op != "call_method" or weight.target != "to" or len(weight.users) != 1:
        return None
    source = weight.args[0]
    if not isinstance(source, fx.Node) or source.op != "placeholder":
        return None
    value, parameter = _example(weight), _example(source)
    if value is None or parameter is None or value.dim() != 2 or not all(isinstance(d, int) for d in value.shape):
        return None
    if value.requires_grad != parameter.requires_grad:  # cast under no_grad: moved, it would carry a gradient
        return None
    return value if 2 * value.shape[0] <= value.shape[1] else None


def _groups(graph: fx.Graph) -> list[list[tuple[fx.Node, torch.Tensor]]]:
    """The adapter linears of `graph` that may become one, in graph order, at least two a group: the same input, the
    same weight dtype and device, outputs alike (dtype: the same autocast state; requires_grad: the same grad mode,
    since a linear under no_grad, grouped with others, would pass gradients), no in-place op between them."""
    found: dict[tuple, list[tuple[fx.Node, torch.Tensor]]] = {}
    mutations = 0
    for node in graph.nodes:
        if _in_place(node):
            mutations += 1
            continue
        weight = _adapter_factor(node)
        output = _example(node) if weight is not None else None
        if output is not None:
            key = (node.args[0], weight.dtype, weight.device, output.dtype, output.requires_grad, mutations)
            found.setdefault(key, []).append((node, weight))
    return [members for members in found.values() if len(members) > 1]


def _group(graph: fx.Graph, members: list[tuple[fx.Node, torch.Tensor]]) -> bool:
    """Replace `members` by one linear over their concatenated weights and a split, at the first one's place, the later
    ones' casts moved up there (each reads a parameter, which exists from the graph's start). False where together
    they are no longer narrow (the traced checkpoint's policy would then treat the matmul as a widening one)."""
    if 2 * sum(weight.shape[0] for _, weight in members) > members[0][1].shape[1]:
        return False
    first = members[0][0]
    x = first.args[0]
    for node, _ in members[1:]:
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
