"""What the ops take, checked before any kernel runs: the sizes a step knows on the host, and the inputs' shapes.

Shared by the reference, Triton and CPU paths of scoring, selection and decode attention, so that
each raises the same clear error for the same mistake.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .layout import check_centroids, check_paged_cache
from .pages import num_pages


class DecodeBounds(NamedTuple):
    """What a decode step's Triton kernels would otherwise read from the device, known on the host.

    `max_seq_len`: at least the longest row (sizes the score buffer and the selection tile);
    `width`: at least the most pages any row selects, min(pages, budget) (sizes the selection).
    Upper bounds are safe (wider buffers, -inf and -1 padded); anything less is not checked on
    the device and cuts rows short. Build them with `decode_bounds`, which checks the rows as the
    kernels' own checks would.
    """

    max_seq_len: int
    width: int


def decode_bounds(seq_lens: Sequence[int], budgets: Sequence[int], sink: int, local: int) -> DecodeBounds:
    """`DecodeBounds` of rows of these lengths and budgets (in pages), checked as the kernels check them.

    Plain Python over host values: what spares a GPU decode step its host syncs.
    """
    if len(seq_lens) != len(budgets):
        raise ValueError(f"{len(seq_lens)} lengths but {len(budgets)} budgets")
    if sink < 0 or local < 0:
        raise ValueError(f"sink ({sink}) and local ({local}) page counts must be >= 0")
    longest, width = 0, 0
    for n_tokens, k in zip(seq_lens, budgets, strict=True):
        if n_tokens < 1:
            raise ValueError("every row must hold at least one cached token")
        n = num_pages(n_tokens)
        if n > k and k < sink + local:
            raise ValueError(f"a budget of fewer than {sink + local} pages cannot hold the sink and local pages")
        longest, width = max(longest, n_tokens), max(width, min(n, k))
    return DecodeBounds(longest, width)


def group_mean_query(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[rows, q_heads, d] -> [rows, kv_heads, d]: mean over the query heads sharing each KV head."""
    rows, hq, d = q.shape
    if hq % num_kv_heads != 0:
        raise ValueError(f"{hq} query heads cannot share {num_kv_heads} KV heads evenly")
    return q.float().view(rows, num_kv_heads, hq // num_kv_heads, d).mean(dim=2)


def check_score_inputs(
    q: torch.Tensor,
    centroids: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int | None = None,
) -> None:
    """Raise ValueError when the query, the centroids and the cache do not fit together."""
    check_paged_cache(k_cache, None, block_table, seq_lens, max_seq_len)
    check_centroids(centroids, k_cache)
    if q.dim() != 3 or q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"q must be [rows={seq_lens.shape[0]}, q_heads, head_dim], got shape {tuple(q.shape)}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head_dim {q.shape[2]} differs from the cache's {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k_cache.shape[1]} KV heads evenly")


def check_selection_inputs(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    budgets: torch.Tensor,
    sink: int,
    local: int,
    bounds: DecodeBounds | None = None,
) -> None:
    """Raise ValueError when scores, lengths and budgets (in pages) do not fit the selection rule.

    With `bounds` (checked on the host by `decode_bounds`) nothing is read from the device.
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must be [rows, kv_heads, pages], got shape {tuple(scores.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != scores.shape[0]:
        raise ValueError(f"seq_lens must be [rows={scores.shape[0]}], got shape {tuple(seq_lens.shape)}")
    if budgets.shape != seq_lens.shape:
        raise ValueError(f"budgets {tuple(budgets.shape)} and seq_lens {tuple(seq_lens.shape)} must match")
    if sink < 0 or local < 0:
        raise ValueError(f"sink ({sink}) and local ({local}) page counts must be >= 0")
    if bounds is not None:
        if num_pages(bounds.max_seq_len) > scores.shape[2]:
            raise ValueError(f"scores hold {scores.shape[2]} pages but a row may have {bounds.max_seq_len} tokens")
        return
    if seq_lens.numel() == 0:
        return
    n = num_pages(seq_lens.long())
    if int(n.max()) > scores.shape[2]:
        raise ValueError(f"scores hold {scores.shape[2]} pages but a row has {int(n.max())}")
    if bool(((n > budgets.long()) & (budgets.long() < sink + local)).any()):
        raise ValueError(f"a budget of fewer than {sink + local} pages cannot hold the sink and local pages")


def check_decode_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_indices: torch.Tensor | None,
    seq_lens: torch.Tensor | None = None,
) -> None:
    """Raise ValueError when the query or the page indices do not fit the cache (or `seq_lens`' rows)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [rows, q_heads, head_dim], got shape {tuple(q.shape)}")
    if seq_lens is not None and q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows but seq_lens has {seq_lens.shape[0]}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head_dim {q.shape[2]} differs from the cache's {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k_cache.shape[1]} KV heads evenly")
    if page_indices is not None and (
        page_indices.dim() != 3 or page_indices.shape[:2] != (q.shape[0], k_cache.shape[1])
    ):
        raise ValueError(
            f"page_indices must be [rows={q.shape[0]}, kv_heads={k_cache.shape[1]}, n], got {tuple(page_indices.shape)}"
        )


def check_prefill_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> None:
    """Raise ValueError unless q, the rows' query spans and their lengths fit together and the cache."""
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"q must be [tokens, q_heads, head_dim] matching the cache, got {tuple(q.shape)}")
    rows = seq_lens.shape[0]
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != rows + 1:
        raise ValueError(f"query_start_loc must be [rows + 1] = [{rows + 1}], got {tuple(query_start_loc.shape)}")
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if rows and (bool((q_lens < 0).any()) or bool((q_lens > seq_lens).any()) or int(query_start_loc[-1]) > q.shape[0]):
        raise ValueError("each row's query tokens must be a span of q no longer than the row (seq_lens)")
