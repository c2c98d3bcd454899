"""pref.share_prompt's attention: a shared row [prompt, chosen, rejected] as two causal attentions, with no mask.

The row's attention mask (data/preference.py, collate_shared_pairs) says what each token sees: the prompt and the
chosen tokens causally, the rejected tokens the prompt and themselves. Given to SDPA, such a mask rules out its
causal kernels (flash, cuDNN) for a masked one that computes every block of the [L, L] matrix. The same attention
is two causal ones: [prompt, chosen] over itself, and [prompt, rejected] over itself, keeping the rejected tokens'
outputs (the prompt's self-attention runs twice, the projections and MLPs of its tokens once). So the batch also
carries each row's token indices of the two (`SHARED_ROWS`), which transformers hands to the attention function
with the model's other keyword arguments; this module's function, registered as transformers' "sdpa", takes them
and leaves every call without them to transformers' own. The mask still goes with the batch: a model whose
attention does not pass the keyword arguments on computes the same with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

# The model keyword (and batch key) of a shared batch's rows: per row, (the indices of its prompt and chosen
# tokens, of its prompt and rejected tokens, of the rejected tokens among the latter).
SHARED_ROWS = "shared_prompt_rows"


def shared_row_indices(prompt: int, chosen: int, rejected: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A shared row's (prompt + chosen, prompt + rejected, rejected within the second) token indices."""
    first = torch.arange(prompt + chosen)
    second = torch.cat([torch.arange(prompt), torch.arange(prompt + chosen, prompt + chosen + rejected)])
    return first, second, torch.arange(prompt, prompt + rejected)


def shared_prompt_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                            **kwargs):
    """transformers' sdpa attention, but for a shared batch (`SHARED_ROWS` given) each row's two causal attentions
    through SDPA's causal kernel; query, key, value [batch, heads, L, dim], the output [batch, L, heads, dim] with
    zeros at the padding."""
    rows = kwargs.pop(SHARED_ROWS, None)
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    outputs = []
    for b, (first, second, rejected) in enumerate(rows):
        parts = []
        for index in (first, second):
            q, k, v = (t[b : b + 1].index_select(2, index) for t in (query, key, value))
            parts.append(sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling,
                                                is_causal=True, **kwargs)[0])
        row = torch.cat([parts[0], parts[1].index_select(1, rejected)], dim=1)
        outputs.append(F.pad(row, (0, 0, 0, 0, 0, query.shape[2] - row.shape[1])))
    return torch.cat(outputs), None


def use_shared_prompt_attention() -> None:
    """Register `shared_prompt_attention` as transformers' "sdpa" attention (once; calls without `SHARED_ROWS` are
    transformers' own)."""
    AttentionInterface.register("sdpa", shared_prompt_attention)
