"""Sequence-tiled MLP (parallel.mlp_tile_tokens): each block's MLP run a tile of tokens at a time.

Why: with checkpointed (and offloaded) blocks, the GPU peak at long context is the recompute working set of
one block, and the MLP's share of it is its widening intermediates (gate, up, activation, product and their
adapters' paths: several [tokens, intermediate_size] tensors). The MLP is token-wise, so it can run a tile at
a time, keeping only its input for backward; in backward each tile is recomputed and its gradients taken
before the next, so no more than one tile's intermediates exist at once. Parameter gradients are summed over
the tiles in fp32 and returned to autograd as the gradients of the parameters the MLP ran with (under FSDP2
the gathered ones, whose gradients FSDP2 reduce-scatters after the block's backward).

Two autograd nodes, so that each tile's forward runs twice a step, not three times, in a checkpointed block:
`_TiledMLP` saves the input and does the tiles' backward; `_TileOutputs`, after it, computes the output
without grad and hands the output's gradient back to it. The input is thus saved before any tile runs, and
a block checkpoint's recompute, which stops once it has recomputed the last tensor the block saved (torch's
early stop), stops there: it reruns attention, not the MLP. (A reentrant checkpoint reruns it all.)

Under parallel.compile the tiling loop stays eager (the block's compiled graph breaks around it), while one
tile's MLP is a compiled graph of its own, reused for every tile and block (`compile_tiles`), except where the
MLP's quantized storage is in host memory (parallel.cpu_offload). Each tile dequantizes the quantized base
weights again.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from qshard.errors import QShardError
from qshard.quant import QuantizedExperts, QuantizedLinear


class _Tiled:
    """A tiled MLP's forward: `run` (one tile's MLP) `tile` tokens at a time; `rng`: whether backward must redraw
    the forward's dropout masks."""

    def __init__(self, mlp: nn.Module, run, tile: int, rng: bool) -> None:
        self.mlp, self.run, self.tile, self.rng = mlp, run, tile, rng

    @torch.compiler.disable  # the loop and the tiles' backward stay eager; `run` may be compiled
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= self.tile:  # one tile: the plain forward, with nothing to recompute
            return self.run(x)
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            return _tiles(self.run, x, self.tile)
        call = _Call(self)
        token = _TiledMLP.apply(x, call, *params)
        return _TileOutputs.apply(token, x.detach(), call)


class _Call:
    """What one call's two nodes share: the tiling, the random state at its start, the output's gradient."""

    def __init__(self, tiled: _Tiled) -> None:
        self.tiled, self.rng_state, self.grad_out = tiled, None, None


class _TiledMLP(torch.autograd.Function):
    """Saves x (the MLP's input) and returns an empty token that `_TileOutputs` takes; its backward computes the
    tiles' gradients from the output's gradient `_TileOutputs` left in `call`."""

    @staticmethod
    def forward(ctx, x, call, *params):
        ctx.save_for_backward(x)
        ctx.call, ctx.params = call, params
        call.rng_state = _rng_state(x.device) if call.tiled.rng else None
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        (x,) = ctx.saved_tensors
        call = ctx.call
        grad_out, call.grad_out = call.grad_out, None
        need_x, need_params = ctx.needs_input_grad[0], ctx.needs_input_grad[2:]
        wanted = [p for p, need in zip(ctx.params, need_params) if need]
        grad_x, sums = _tile_gradients(call, x, grad_out, need_x, wanted)
        by_param = iter(total.to(p.dtype) for total, p in zip(sums, wanted))
        param_grads = [next(by_param) if need else None for need in need_params]
        return grad_x, None, *param_grads


class _TileOutputs(torch.autograd.Function):
    """The MLP's output, computed tile by tile without grad; backward passes the output's gradient to
    `_TiledMLP` (through `call`) and nothing to the token."""

    @staticmethod
    def forward(ctx, token, x, call):
        ctx.call = call
        with torch.no_grad():
            return _tiles(call.tiled.run, x, call.tiled.tile)

    @staticmethod
    def backward(ctx, grad_out):
        ctx.call.grad_out = grad_out
        return grad_out.new_zeros(0), None, None


def _tile_gradients(call: _Call, x: torch.Tensor, grad_out: torch.Tensor, need_x: bool, wanted: list):
    """Each tile's forward and backward in turn: x's gradient (or None) and the fp32 sums of `wanted`'s."""
    run, tile = call.tiled.run, call.tiled.tile
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in wanted]
    flat_x, flat_grad = _tokens(x), _tokens(grad_out)
    grad_x = torch.empty_like(flat_x) if need_x else None
    with _replayed_rng(call.rng_state, x.device), torch.enable_grad():
        for start in range(0, flat_x.shape[0], tile):
            end = start + tile
            piece = flat_x[start:end].detach().requires_grad_(need_x)
            out = run(piece.unsqueeze(0))
            inputs = [piece, *wanted] if need_x else wanted
            grads = list(torch.autograd.grad(out, inputs, flat_grad[start:end].unsqueeze(0), allow_unused=True))
            if need_x:
                grad_x[start:end] = grads.pop(0)
            for total, grad in zip(sums, grads):
                if grad is not None:
                    total += grad
    return (None if grad_x is None else grad_x.view_as(x)), sums


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> [tokens, hidden]: the MLP is token-wise, so batch rows and positions tile alike."""
    return t.reshape(-1, t.shape[-1])


def _tiles(run, x: torch.Tensor, tile: int) -> torch.Tensor:
    """run(x), `tile` tokens at a time, written into one output (no list of pieces to concatenate)."""
    flat = _tokens(x)
    out = None
    for start in range(0, flat.shape[0], tile):
        piece = run(flat[start:start + tile].unsqueeze(0)).squeeze(0)
        if out is None:
            out = piece.new_empty(flat.shape[0], piece.shape[-1])
        out[start:start + tile] = piece
    return out.view(*x.shape[:-1], out.shape[-1])


def _rng_state(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


class _replayed_rng:  # noqa: N801 (a context manager, used like one)
    """Within: the random state the forward began with (so the tiles' dropout masks are drawn again exactly);
    after: the state as it was. Nothing when `state` is None (the MLP draws no random numbers)."""

    def __init__(self, state, device: torch.device) -> None:
        self.state, self.device = state, device

    def __enter__(self):
        if self.state is not None:
            self.saved = _rng_state(self.device)
            _set_rng_state(self.state, self.device)

    def __exit__(self, *exc):
        if self.state is not None:
            _set_rng_state(self.saved, self.device)


def _set_rng_state(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def tile_mlps(model: nn.Module, blocks: list[nn.Module], tile: int) -> None:
    """Make each block's `mlp` run `tile` tokens at a time (see the module docstring); nothing for `tile` 0.
    The module stays where it is (its parameter names unchanged): only its forward is wrapped."""
    if tile <= 0:
        return
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise QShardError(f"parallel.mlp_tile_tokens: the blocks of {type(model).__name__} "
                              f"({type(block).__name__}) have no `mlp` module to tile; set parallel.mlp_tile_tokens 0")
        if _has_experts(mlp):
            raise QShardError(f"parallel.mlp_tile_tokens: the blocks of {type(model).__name__} have a mixture-of-"
                              f"experts MLP ({type(mlp).__name__}), which qshard does not tile; set "
                              "parallel.mlp_tile_tokens 0")
        # Decided here, once: whether backward must redraw the forward's dropout masks.
        rng = any(isinstance(m, nn.Dropout) and m.p > 0 for m in mlp.modules())
        mlp.forward = _Tiled(mlp, mlp.forward, tile, rng)


def compile_tiles(blocks: list[nn.Module], backend: str, options: dict | None) -> None:
    """Compile one tile's MLP, once per MLP class (its parameters are graph inputs, so every block's MLP and
    every tile reuse the graph); the tiling around it stays eager. MLPs that draw dropout masks stay eager:
    the tiles' backward redraws each mask from the random state the forward began with, which only eager ops
    are known to draw alike. So do MLPs whose quantized storage is in host memory (`storage_offloaded`)."""
    compiled = {}
    for block in blocks:
        tiled = getattr(getattr(block, "mlp", None), "forward", None)
        if isinstance(tiled, _Tiled) and not tiled.rng and not storage_offloaded(tiled.mlp):
            cls = type(tiled.mlp)
            if cls not in compiled:
                compiled[cls] = torch.compile(cls.forward, backend=backend, options=options)
            tiled.run = functools.partial(compiled[cls], tiled.mlp)


def storage_offloaded(mlp: nn.Module) -> bool:
    """Whether some quantized layer of `mlp` keeps its storage in host memory (parallel.cpu_offload, outside the
    resident blocks). A compiled graph would copy that storage to the device in every call, once per tile; run
    eagerly, the tiles fetch it through the offload window, which copies a block's storage once per direction
    (parallel/storage_offload.py, StorageWindow)."""
    return any(isinstance(m, QuantizedLinear) and m.offloaded is not None and not m.offloaded.resident
               for m in mlp.modules())


def tileable(blocks: list[nn.Module]) -> bool:
    """Whether `tile_mlps` takes these blocks: each has an `mlp` module, none of experts."""
    return all(isinstance(getattr(b, "mlp", None), nn.Module) and not _has_experts(b.mlp) for b in blocks)


def _has_experts(mlp: nn.Module) -> bool:
    return any(isinstance(m, QuantizedExperts) or name.rsplit(".", 1)[-1] == "experts"
               for name, m in mlp.named_modules())
