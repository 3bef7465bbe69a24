"""Teacher-forced block-sparse attention: the training-side twin of sparse decode.

Every query position t of a sequence selects pages exactly as the decode step that produced it
did: from the t + 1 tokens cached then, with the budget the schedule gave that position, scored
with the same centroids, the same group-mean query, sink and local pages. So one pass over a whole
sequence reproduces token-by-token sparse decode.
"""

from __future__ import annotations

import math

import torch

from .backend import resolve_backend
from .centroids import new_centroids, update_centroids_ref, update_centroids_triton
from .decode import sparse_decode_attention_triton
from .pages import PAGE_SIZE
from .select import score_blocks, score_blocks_triton, select_blocks_triton, selection_mask_ref


def check_teacher_forced_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, budgets: torch.Tensor, local: int = 2
) -> None:
    """Raise ValueError when the shapes do not fit [batch, seq, heads, head_dim] and budgets [batch, seq].

    `local` must be at least 1: the centroids are computed once from the whole sequence, so a
    partial page holds later keys than position t saw; only with it always local is it never scored.
    """
    if local < 1:
        raise ValueError(f"teacher-forced selection needs local >= 1 (the current page is always kept), got {local}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [batch, seq, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"{q.shape[2]} query heads cannot share {k.shape[2]} KV heads evenly")
    if tuple(budgets.shape) != tuple(q.shape[:2]):
        raise ValueError(f"budgets must be [batch, seq] = {tuple(q.shape[:2])}, got {tuple(budgets.shape)}")


def as_paged_cache(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """View whole sequences [batch, seq, kv_heads, d] as a paged cache with one block per sequence.

    Returns the cache [batch, kv_heads, padded_seq, d] and its block table [batch, 1].
    """
    b, t, h, d = k.shape
    padded = -(-t // PAGE_SIZE) * PAGE_SIZE
    cache = torch.zeros(b, h, padded, d, dtype=k.dtype, device=k.device)
    cache[:, :, :t] = k.detach().transpose(1, 2)
    table = torch.arange(b, dtype=torch.int32, device=k.device)[:, None]
    return cache, table


@torch.no_grad()
def teacher_forced_selection_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    budgets: torch.Tensor,
    sink: int = 1,
    local: int = 2,
    chunk: int = 1024,
    score_backend: str = "torch",
) -> torch.Tensor:
    """Bool [batch, seq, kv_heads, pages]: the pages each position attends to, as decode chose them.

    Pages are scored by `score_backend`: to reproduce an engine's selection exactly, score as it does.
    """
    b, t, hq, _ = q.shape
    cache, table = as_paged_cache(k)
    centroids = new_centroids(cache)
    update_centroids_ref(cache, centroids, table, torch.full((b,), t, device=k.device))
    pages = cache.shape[2] // PAGE_SIZE
    out = torch.zeros(b, t, k.shape[2], pages, dtype=torch.bool, device=q.device)
    positions = torch.arange(t, device=q.device)
    for bi in range(b):
        for start in range(0, t, chunk):
            stop = min(t, start + chunk)
            lens = positions[start:stop] + 1
            rows_table = table[bi : bi + 1].expand(stop - start, 1)
            scores = score_blocks(q[bi, start:stop].detach(), centroids, cache, rows_table, lens, backend=score_backend)
            mask = selection_mask_ref(scores, lens, budgets[bi, start:stop], sink, local)
            out[bi, start:stop, :, : mask.shape[2]] = mask
    return out


def teacher_forced_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    budgets: torch.Tensor,
    sink: int = 1,
    local: int = 2,
    scale: float | None = None,
    chunk: int = 1024,
    score_backend: str = "torch",
) -> torch.Tensor:
    """Output [batch, seq, q_heads, d] of block-sparse causal attention, position t under budgets[:, t] pages.

    Differentiable in q, k and v (selection itself is discrete). A budget covering the whole prefix
    gives dense causal attention, which is how callers make prompt positions dense. Pages are
    scored by `score_backend` (see `teacher_forced_selection_ref`).
    """
    check_teacher_forced_inputs(q, k, v, budgets, local)
    b, t, hq, d = q.shape
    h = k.shape[2]
    g = hq // h
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    selected = teacher_forced_selection_ref(q, k, budgets, sink, local, chunk, score_backend)  # [b, t, h, pages]
    key_page = torch.arange(t, device=q.device) // PAGE_SIZE
    qh = q.transpose(1, 2)  # [b, hq, t, d]
    kh = k.transpose(1, 2).repeat_interleave(g, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(g, dim=1)
    outs = []
    for start in range(0, t, chunk):
        stop = min(t, start + chunk)
        rows = torch.arange(start, stop, device=q.device)
        causal = key_page.new_ones(()).bool() & (torch.arange(t, device=q.device)[None, :] <= rows[:, None])
        allowed = selected[:, start:stop][..., key_page]  # [b, c, h, t]
        allowed = (allowed & causal[None, :, None, :]).permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                qh[:, :, start:stop], kh, vh, attn_mask=allowed, scale=scale
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2)


@torch.no_grad()
def teacher_forced_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    budgets: torch.Tensor,
    sink: int = 1,
    local: int = 2,
    scale: float | None = None,
    chunk: int = 1024,
) -> torch.Tensor:
    """Forward-only Triton twin of `teacher_forced_attention_ref`, built from the decode kernels.

    Each sequence becomes a paged cache with one block; every position is then a decode row of
    length t + 1 over that block, scored, selected and attended by the same Triton kernels that
    serve decode, `chunk` rows at a time to bound the scores' memory. No gradients.
    """
    check_teacher_forced_inputs(q, k, v, budgets, local)
    b, t, hq, d = q.shape
    k_cache, table = as_paged_cache(k)
    v_cache, _ = as_paged_cache(v)
    centroids = new_centroids(k_cache)
    update_centroids_triton(k_cache, centroids, table, torch.full((b,), t, dtype=torch.int32, device=k.device))
    rows = b * t
    q_rows = q.reshape(rows, hq, d).contiguous()
    row_table = table.repeat_interleave(t, dim=0)
    row_lens = torch.arange(1, t + 1, dtype=torch.int32, device=q.device).repeat(b)
    row_budgets = budgets.reshape(rows)
    out = torch.empty_like(q_rows)
    for start in range(0, rows, chunk):
        part = slice(start, min(rows, start + chunk))
        scores = score_blocks_triton(q_rows[part], centroids, k_cache, row_table[part], row_lens[part])
        pages = select_blocks_triton(scores, row_lens[part], row_budgets[part], sink, local)
        out[part] = sparse_decode_attention_triton(
            q_rows[part], k_cache, v_cache, row_table[part], row_lens[part], pages, scale
        )
    return out.view(b, t, hq, d)


def teacher_forced_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    budgets: torch.Tensor,
    sink: int = 1,
    local: int = 2,
    scale: float | None = None,
    chunk: int = 1024,
    backend: str = "auto",
) -> torch.Tensor:
    """Block-sparse causal attention [batch, seq, q_heads, d], position t selecting as its decode step did.

    `budgets` [batch, seq] are in pages. `backend`: see `kernels.backend.resolve_backend`. The
    Triton path is forward-only: whenever gradients are enabled and q, k or v requires grad, the
    differentiable torch reference runs instead, with pages still scored by the resolved backend
    so that the selection is the one that backend's decode makes.
    """
    which = resolve_backend(backend, q)
    wants_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if which == "triton" and not wants_grad:
        return teacher_forced_attention_triton(q, k, v, budgets, sink, local, scale, chunk)
    return teacher_forced_attention_ref(q, k, v, budgets, sink, local, scale, chunk, score_backend=which)
