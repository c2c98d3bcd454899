"""Sequence-tiled MLP (parallel.mlp_tile_tokens): each block's MLP run a tile of tokens at a time.

Why: with checkpointed (and offloaded) blocks, the GPU peak at long context is the recompute working set of
one block, and the MLP's share of it is its widening intermediates (gate, up, activation, product and their
adapters' paths: several [tokens, intermediate_size] tensors). The MLP is token-wise, so it can run a tile at
a time: `_TiledMLP` keeps only its input for backward and, in backward, recomputes each tile and takes its
gradients before the next, so no more than one tile's intermediates exist at once. Parameter gradients are
summed over the tiles in fp32 and returned to autograd as the gradients of the parameters the MLP ran with
(under FSDP2 the gathered ones, whose gradients FSDP2 reduce-scatters after the block's backward).

The cost: each tile's forward runs once more in backward (under activation checkpointing, the block's
recompute runs the tiles' forward as well), and each tile dequantizes the quantized base weights again.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from qshard.errors import QShardError
from qshard.quant import QuantizedExperts


class _TiledMLP(torch.autograd.Function):
    """y = run(x) computed `tile` tokens at a time; `params` are the trainable parameters `run` uses."""

    @staticmethod
    def forward(ctx, x, run, tile, rng, *params):
        ctx.save_for_backward(x)
        ctx.run, ctx.tile, ctx.params = run, tile, params
        ctx.rng = _rng_state(x.device) if rng else None
        with torch.no_grad():
            return _tiles(run, x, tile)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        need_x, *need_params = ctx.needs_input_grad[0], *ctx.needs_input_grad[4:]
        wanted = [p for p, need in zip(ctx.params, need_params) if need]
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in wanted]
        flat_x, flat_grad = _tokens(x), _tokens(grad_out)
        grad_x = torch.empty_like(flat_x) if need_x else None
        with _replayed_rng(ctx.rng, x.device), torch.enable_grad():
            for start in range(0, flat_x.shape[0], ctx.tile):
                end = start + ctx.tile
                piece = flat_x[start:end].detach().requires_grad_(need_x)
                out = ctx.run(piece.unsqueeze(0))
                inputs = [piece, *wanted] if need_x else wanted
                grads = list(torch.autograd.grad(out, inputs, flat_grad[start:end].unsqueeze(0), allow_unused=True))
                if need_x:
                    grad_x[start:end] = grads.pop(0)
                for total, grad in zip(sums, grads):
                    if grad is not None:
                        total += grad
        by_param = iter(total.to(p.dtype) for total, p in zip(sums, wanted))
        param_grads = [next(by_param) if need else None for need in need_params]
        return (None if grad_x is None else grad_x.view_as(x)), None, None, None, *param_grads


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


def _tiled_forward(mlp: nn.Module, run, tile: int, rng: bool, x: torch.Tensor) -> torch.Tensor:
    if x.numel() // x.shape[-1] <= tile:  # one tile: the plain forward, with nothing to recompute
        return run(x)
    params = [p for p in mlp.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        return _tiles(run, x, tile)
    return _TiledMLP.apply(x, run, tile, rng, *params)


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
        mlp.forward = functools.partial(_tiled_forward, mlp, mlp.forward, tile, rng)


def tileable(blocks: list[nn.Module]) -> bool:
    """Whether `tile_mlps` takes these blocks: each has an `mlp` module, none of experts."""
    return all(isinstance(getattr(b, "mlp", None), nn.Module) and not _has_experts(b.mlp) for b in blocks)


def _has_experts(mlp: nn.Module) -> bool:
    return any(isinstance(m, QuantizedExperts) or name.rsplit(".", 1)[-1] == "experts"
               for name, m in mlp.named_modules())
