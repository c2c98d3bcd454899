"""pref.share_prompt's attention: a shared row [prompt, chosen, rejected] as two causal attentions, with no mask.

What each token of such a row sees: the prompt and the chosen tokens causally, the rejected tokens the prompt and
themselves, never the chosen ones. That is two causal attentions: [prompt, chosen] over itself, and [prompt,
rejected] over itself, keeping the rejected tokens' outputs (the prompt's self-attention runs twice, the
projections and MLPs of its tokens once), each through SDPA's causal kernels (flash, cuDNN), with memory linear in
the row. The batch carries the indices of the two (`SHARED_ROWS`, data/preference.py collate_shared_pairs), which
transformers hands to the attention function with the model's other keyword arguments; this module's function,
registered as transformers' "sdpa", takes them and leaves every call without them to transformers' own.

No mask goes with such a batch: the model gets a 4D placeholder that costs no memory (`mask_placeholder`, 4D so
that transformers neither builds a mask of its own nor reads the restarting positions as packed rows). A model
whose attention does not pass the keyword arguments on would attend through that placeholder, not causally:
`check_rows_taken` counts the calls that took the rows in a batch's first forward and stops the run where a layer
did not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from qshard.errors import QShardError
from qshard.parallel.kept_attention import kept_attention, takes

# The model keyword (and batch key) of a shared batch's rows, three index tensors of the batch (so that a compiled
# block's graph does not depend on how many pairs it holds): `second` [pairs, L2], each row's prompt and rejected
# token positions (right-padded with 0); `first` [L1], the positions of the longest prompt + chosen (every row's
# first attention is a prefix of it); `source` [pairs, L], where each position's output is in the two attentions'
# outputs concatenated (L1 + L2 + 1; the last, zeros, is the padding's).
SHARED_ROWS = "shared_prompt_rows"


def shared_row_indices(sizes: list[tuple[int, int, int]], width: int) -> tuple[torch.Tensor, ...]:
    """`SHARED_ROWS` of rows of (prompt, chosen, rejected) token counts, padded to `width` positions."""
    first_width = max(p + c for p, c, _ in sizes)
    second_width = max(p + r for p, _, r in sizes)
    second = torch.zeros((len(sizes), second_width), dtype=torch.long)
    source = torch.full((len(sizes), width), first_width + second_width, dtype=torch.long)
    for row, (p, c, r) in enumerate(sizes):
        second[row, :p] = torch.arange(p)
        second[row, p : p + r] = torch.arange(p + c, p + c + r)
        source[row, : p + c] = torch.arange(p + c)
        source[row, p + c : p + c + r] = torch.arange(first_width + p, first_width + p + r)
    return torch.arange(first_width), second, source


class _RowsTaken:
    """Calls of `shared_prompt_attention` that took a batch's rows while counting (`check_rows_taken`)."""

    counting = False
    calls = 0


def shared_prompt_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                            **kwargs):
    """transformers' sdpa attention, but for a shared batch (`SHARED_ROWS` given) each row's two causal attentions
    through SDPA's causal kernel; query, key, value [batch, heads, L, dim], the output [batch, L, heads, dim] with
    zeros at the padding."""
    rows = kwargs.pop(SHARED_ROWS, None)
    if rows is None:
        if takes(module, query, key, attention_mask, dropout, is_causal, kwargs):
            out = kept_attention(module, query, key, value, scaling)
            if out is not None:
                return out, None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if _RowsTaken.counting and not torch.compiler.is_compiling():
        _RowsTaken.calls += 1
    first, second, source = rows
    batch = torch.arange(query.shape[0], device=query.device)[:, None]
    width = first.shape[0]
    outputs = [sdpa_attention_forward(module, *(t[:, :, :width] for t in (query, key, value)), None, dropout=dropout,
                                      scaling=scaling, is_causal=True, **kwargs)[0]]
    # Advanced indices around a slice put their dimension first: [pairs, L2, heads, dim].
    q, k, v = (t[batch, :, second].transpose(1, 2) for t in (query, key, value))
    outputs.append(sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True,
                                          **kwargs)[0])
    outputs.append(outputs[0].new_zeros(outputs[0].shape[0], 1, *outputs[0].shape[2:]))
    return torch.cat(outputs, dim=1)[batch, source], None


def mask_placeholder(tokens: torch.Tensor) -> torch.Tensor:
    """The attention mask a shared batch of `tokens` ([pairs, L] ids or [pairs, L, hidden] embeddings) gives the
    model: [pairs, 1, L, L] of one element (a 4D mask transformers uses as it is; the attention never reads it)."""
    n, width = tokens.shape[:2]
    return torch.ones((), dtype=torch.bool, device=tokens.device).expand(n, 1, width, width)


@contextlib.contextmanager
def check_rows_taken(model: torch.nn.Module) -> Iterator[None]:
    """Around a model's first forward of a shared batch: fail with one line where fewer of its attention calls took
    the rows than it has layers (an attention that does not pass transformers' keyword arguments on). Run eagerly,
    so that the count is of the calls themselves, not of a compiled graph's."""
    _RowsTaken.counting, _RowsTaken.calls = True, 0
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        _RowsTaken.counting = False
    layers = model.config.get_text_config().num_hidden_layers
    if _RowsTaken.calls < layers:
        name = next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
        raise QShardError(
            f"pref.share_prompt: {name}'s attention took the shared rows in {_RowsTaken.calls} of its {layers} "
            "layers (it does not pass transformers' attention keyword arguments on), so its rejected tokens would "
            "see the chosen ones; set pref.share_prompt: false (each pair as two rows)")


def use_shared_prompt_attention() -> None:
    """Register `shared_prompt_attention` as transformers' "sdpa" attention (once; calls without `SHARED_ROWS` are
    transformers' own)."""
    AttentionInterface.register("sdpa", shared_prompt_attention)
