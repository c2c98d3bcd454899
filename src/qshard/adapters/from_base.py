"""PiSSA and OLoRA: adapters whose initial factors come from the frozen base weight, which then holds only the rest.

PiSSA (Meng et al. 2024) starts B0 A0 at the best rank-r approximation of W, its top-r singular triplets with
sqrt(S) on each side (pissa_niter_N: an approximate one, far cheaper than a full SVD on large layers); OLoRA
(Buyukakyuz 2024) at W's projection on its first r QR directions (B0 the first r columns of Q, A0 the first r
rows of R). Either way the base keeps the residual W - scaling B0 A0, so training starts from the base
model's function with the adapter on W's principal part; on a quantized base that residual is what gets
quantized. The split is computed in fp32 on the device the weight streams to, once per linear, at every build
(training, resume, export): the residual depends only on the product B0 A0, which neither the signs nor the
device's algorithm change (pissa_niter_N's random sketch is drawn on the host from a fixed seed), so a resume
rebuilds the same base and the trained A, B come from the checkpoint.

peft applies an adapter to the original W, so the export writes the plain LoRA of rank 2r whose update is what
training added, B A - B0 A0 = [B | -B0] [A ; A0] (`as_plain_lora`), with alpha adjusted to keep the scaling.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch


def pissa_factors(weight: torch.Tensor, rank: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A0 [r, in], B0 [out, r]) with scaling * B0 A0 = U_r S_r V_r^T, the top-r singular part of `weight`."""
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    return _split_singular(u, s, vh, rank, scaling)


def fast_pissa_factors(weight: torch.Tensor, rank: int, scaling: float, niter: int) -> tuple[torch.Tensor, ...]:
    """PiSSA's factors from an approximate top-r SVD (peft's pissa_niter_N; Halko et al.'s randomized range finder
    with `niter` subspace iterations): a few matmuls and QRs instead of a full SVD. The sketch is drawn on the host
    from a fixed seed, so that every build, on any device, starts from the same one."""
    sketch = torch.randn(weight.shape[1], rank, generator=torch.Generator().manual_seed(0)).to(weight.device)
    basis = torch.linalg.qr(weight @ sketch).Q
    for _ in range(niter):
        basis = torch.linalg.qr(weight @ torch.linalg.qr(weight.T @ basis).Q).Q
    u, s, vh = torch.linalg.svd(basis.T @ weight, full_matrices=False)
    return _split_singular(basis @ u, s, vh, rank, scaling)


def _split_singular(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, rank: int, scaling: float):
    """sqrt(S_r / scaling) on each side: (A0, B0) with scaling * B0 A0 = U_r S_r V_r^T."""
    root = (s[:rank] / scaling).sqrt()
    return root[:, None] * vh[:rank], u[:, :rank] * root


def olora_factors(weight: torch.Tensor, rank: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A0, B0) = (first r rows of R, first r columns of Q) for weight = Q R; as OLoRA (and peft) take them, the
    scaling is not divided out."""
    q, r = torch.linalg.qr(weight)
    return r[:rank], q[:, :rank]


# lora.init values (peft's init_lora_weights names) whose adapters start from the base weight; pissa_niter_N too.
FROM_BASE = {"pissa": pissa_factors, "olora": olora_factors}
FAST_PISSA = re.compile(r"pissa_niter_(\d+)")


def factors_from_base(init: str) -> Callable | None:
    """How lora.init `init` splits a base weight: (weight, rank, scaling) -> (A0, B0); None for the default init."""
    fast = FAST_PISSA.fullmatch(init)
    if fast:
        return functools.partial(fast_pissa_factors, niter=int(fast.group(1)))
    return FROM_BASE.get(init)


def as_plain_lora(a: torch.Tensor, b: torch.Tensor, a0: torch.Tensor, b0: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rank-2r (A', B') with B' A' = B A - B0 A0: the trained adapter as a LoRA on the original weight."""
    return torch.cat([a, a0.to(a.dtype)], dim=0), torch.cat([b, -b0.to(b.dtype)], dim=1)


def plain_lora_alpha(alpha: float, use_rslora: bool) -> float:
    """The alpha that gives rank 2r the scaling that rank r had: alpha/r or alpha/sqrt(r)."""
    return alpha * (2**0.5 if use_rslora else 2)
