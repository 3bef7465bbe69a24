"""Dense causal attention of several query tokens per row over a paged KV cache.

Row r's query tokens are `q[query_start_loc[r] : query_start_loc[r + 1]]`, the last `q_len` positions of its
`seq_lens[r]` tokens, whose keys and values are already in the cache: its i-th query token attends positions
`0 .. seq_lens[r] - q_len + i`. A prefill chunk is such a row, and so is a speculative verify (the k drafts and
the token before them). Query head i reads KV head i // (q_heads // kv_heads).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .backend import resolve_backend
from .inputs import check_prefill_inputs
from .layout import check_paged_cache


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention output [tokens, q_heads, head_dim] (dtype of q): each row's prefix copied out of the cache, SDPA."""
    check_paged_cache(k_cache, v_cache, block_table, seq_lens)
    check_prefill_inputs(q, k_cache, seq_lens, query_start_loc)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    out = torch.zeros_like(q)
    bs, h, d = k_cache.shape[2], k_cache.shape[1], k_cache.shape[3]
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        s, e = starts[r], starts[r + 1]
        if e == s:
            continue
        blocks = block_table[r, : -(-seq_len // bs)].long()
        k = k_cache[blocks].permute(1, 0, 2, 3).reshape(h, -1, d)[:, :seq_len]
        v = v_cache[blocks].permute(1, 0, 2, 3).reshape(h, -1, d)[:, :seq_len]
        positions = torch.arange(seq_len - (e - s), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None]
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None].to(k.dtype), k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[s:e] = o[0].transpose(0, 1).to(q.dtype)
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention output [tokens, q_heads, head_dim] of each row's query tokens, causally over its cached tokens.

    The CPU extension reads the cache in place, each page once for all of a row's query tokens (no gradients);
    elsewhere (CUDA tensors, or the torch backend) the reference runs.
    """
    which = resolve_backend(backend, q)
    wants_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k_cache, v_cache))
    if which == "cpu" and not wants_grad:
        from .cpu import paged_prefill_attention_cpu

        return paged_prefill_attention_cpu(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
