"""Block scores and top-k block selection with sink and local blocks.

A row's pages are scored by dot(mean of the GQA group's query heads, page centroid), per KV head.
Selection, per row and KV head, for a row of `n` pages and a budget of `k` pages:
  - n <= k: every page (dense);
  - otherwise the first `sink` pages, the last `local` pages (the current, possibly partial, page
    included) and the top (k - sink - local) pages in between by score, ties going to the lower
    page index. Exactly min(n, k) pages are selected.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import check_same_device, check_unit_stride, resolve_backend
from .inputs import DecodeBounds, check_score_inputs, check_selection_inputs, group_mean_query
from .layout import check_budgets, flat_page_index
from .pages import PAGE_SIZE, num_pages


def score_blocks_ref(
    q: torch.Tensor,
    centroids: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """Scores [rows, kv_heads, max_pages] float32 of every page of every row; -inf past a row's last page."""
    check_score_inputs(q, centroids, k_cache, block_table, seq_lens)
    rows = q.shape[0]
    h, d = centroids.shape[1], centroids.shape[3]
    qm = group_mean_query(q, h)  # [rows, h, d]
    n = num_pages(seq_lens.long())
    max_pages = int(n.max()) if rows else 0
    pages = torch.arange(max_pages, device=q.device)[None, :].expand(rows, max_pages)
    pages = torch.minimum(pages, (n - 1)[:, None])
    index = flat_page_index(block_table, pages[:, None, :].expand(rows, h, max_pages), k_cache.shape[2], h)
    cents = centroids.view(-1, d).index_select(0, index.reshape(-1)).view(rows * h, max_pages, d)
    scores = torch.bmm(cents, qm.reshape(rows * h, d, 1)).view(rows, h, max_pages)
    pages = torch.arange(max_pages, device=q.device)[None, :]
    return scores.masked_fill(pages[:, None, :] >= n[:, None, None], float("-inf"))


def selection_mask_ref(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    budgets: torch.Tensor,
    sink: int = 1,
    local: int = 2,
) -> torch.Tensor:
    """Bool [rows, kv_heads, max_pages]: the pages each row and head attends to (see module doc)."""
    check_selection_inputs(scores, seq_lens, budgets, sink, local)
    rows, h, max_pages = scores.shape
    n = num_pages(seq_lens.long())[:, None]
    k = budgets.long()[:, None]
    sparse = n > k
    p = torch.arange(max_pages, device=scores.device)[None, :]
    valid = p < n
    keep = valid & (~sparse | (p < sink) | (p >= n - local))  # [rows, pages]
    keep = keep[:, None, :].expand(rows, h, max_pages)
    k_mid = torch.where(sparse, k - sink - local, torch.zeros_like(k))  # [rows, 1]
    kmax = int(k_mid.max()) if rows else 0
    if kmax == 0:
        return keep.clone()
    cand = (sparse & (p >= sink) & (p < n - local))[:, None, :]
    cs = scores.float().masked_fill(~cand, float("-inf"))
    top = cs.topk(kmax, dim=-1, sorted=True).values  # [rows, h, kmax]
    kth = top.gather(-1, (k_mid - 1).clamp(min=0)[:, :, None].expand(rows, h, 1))
    above = cand & (cs > kth)
    ties = cand & (cs == kth)
    room = k_mid[:, :, None] - above.sum(-1, keepdim=True)
    chosen = above | (ties & (ties.cumsum(-1) <= room))
    return keep | (chosen & (k_mid > 0)[:, :, None])


def mask_to_indices(mask: torch.Tensor) -> torch.Tensor:
    """Bool [rows, h, pages] -> int32 [rows, h, max selected] of page indices, ascending, padded with -1."""
    rows, h, pages = mask.shape
    width = int(mask.sum(-1).max()) if mask.numel() else 0
    pos = mask.long().cumsum(-1) - 1
    out = torch.full((rows, h, width + 1), -1, dtype=torch.int32, device=mask.device)
    src = torch.arange(pages, dtype=torch.int32, device=mask.device).expand(rows, h, pages)
    out.scatter_(-1, torch.where(mask, pos, torch.full_like(pos, width)), src)
    return out[..., :width]


def select_blocks_ref(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    budgets: torch.Tensor,
    sink: int = 1,
    local: int = 2,
) -> torch.Tensor:
    """Selected page indices int32 [rows, kv_heads, max(min(n, k))], ascending, -1 padded."""
    return mask_to_indices(selection_mask_ref(scores, seq_lens, budgets, sink, local))


def budget_pages(budget_tokens: torch.Tensor) -> torch.Tensor:
    """A budget in tokens (a multiple of the page size) as a number of pages."""
    if bool((budget_tokens % PAGE_SIZE != 0).any()):
        raise ValueError(f"KV budgets must be multiples of {PAGE_SIZE} tokens")
    return budget_tokens // PAGE_SIZE


@triton.jit
def _score_blocks_kernel(
    q_ptr,
    cent_ptr,
    table_ptr,
    seq_lens_ptr,
    budgets_ptr,
    out_ptr,
    stride_qr,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_ch,
    stride_cp,
    stride_cd,
    stride_tr,
    stride_tb,
    stride_or,
    stride_oh,
    stride_op,
    max_pages,
    pages_per_block,
    head_dim,
    group,
    PAGE: tl.constexpr,
    SKIP_DENSE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # One program per (row, kv head, tile of BLOCK_P pages): a mat-vec, too thin for tl.dot.
    # SKIP_DENSE: a row whose budget holds all its pages selects them all, unscored: -inf, no loads.
    row = tl.program_id(0)
    head = tl.program_id(1)
    pages = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim

    q_ptrs = q_ptr + row * stride_qr + (head * group + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_g[:, None] < group) & d_mask[None, :], other=0.0).to(tl.float32)
    q_mean = tl.sum(q, axis=0) / group

    seq_len = tl.load(seq_lens_ptr + row).to(tl.int64)
    n = (seq_len + PAGE - 1) // PAGE
    if SKIP_DENSE:
        n = tl.where(n > tl.load(budgets_ptr + row).to(tl.int64), n, 0)
    live = pages < n
    block = tl.load(table_ptr + row * stride_tr + (pages // pages_per_block) * stride_tb, mask=live, other=0)
    c_ptrs = (
        cent_ptr
        + block.to(tl.int64)[:, None] * stride_cb
        + head * stride_ch
        + (pages % pages_per_block)[:, None] * stride_cp
        + offs_d[None, :] * stride_cd
    )
    cents = tl.load(c_ptrs, mask=live[:, None] & d_mask[None, :], other=0.0)
    scores = tl.where(live, tl.sum(cents * q_mean[None, :], axis=1), float("-inf"))
    tl.store(out_ptr + row * stride_or + head * stride_oh + pages * stride_op, scores, mask=pages < max_pages)


def score_blocks_triton(
    q: torch.Tensor,
    centroids: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    bounds: DecodeBounds | None = None,
    budgets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of `score_blocks_ref`: pages' centroids gathered through the block table and scored.

    With `bounds` the score width is `bounds.max_seq_len`'s pages and nothing is read from the device.
    With `budgets` (in pages, the selection's) a row with no more pages than its budget, which the
    selection takes whole, is not scored: its scores are all -inf and its centroids are not read.
    """
    max_seq_len = None if bounds is None else bounds.max_seq_len
    check_score_inputs(q, centroids, k_cache, block_table, seq_lens, max_seq_len)
    check_budgets(budgets, seq_lens)
    if centroids.dtype != torch.float32:
        raise ValueError(f"centroids must be float32, got {centroids.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    check_same_device(q=q, centroids=centroids, block_table=block_table, seq_lens=seq_lens, budgets=budgets)
    check_unit_stride(q=q, centroids=centroids)
    rows, hq, d = q.shape
    h = centroids.shape[1]
    if max_seq_len is not None:
        max_pages = num_pages(max_seq_len) if rows else 0
    else:
        max_pages = int(num_pages(seq_lens.long()).max()) if rows else 0
    out = torch.empty(rows, h, max_pages, dtype=torch.float32, device=q.device)
    if rows == 0 or max_pages == 0:
        return out
    block_p = min(64, max(16, triton.next_power_of_2(max_pages)))
    _score_blocks_kernel[(rows, h, triton.cdiv(max_pages, block_p))](
        q,
        centroids,
        block_table,
        seq_lens,
        seq_lens if budgets is None else budgets,  # any valid pointer when unused
        out,
        *q.stride(),
        *centroids.stride(),
        *block_table.stride(),
        *out.stride(),
        max_pages,
        centroids.shape[2],
        d,
        hq // h,
        PAGE=PAGE_SIZE,
        SKIP_DENSE=budgets is not None,
        BLOCK_G=triton.next_power_of_2(hq // h),
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_P=block_p,
    )
    return out


@triton.jit
def _select_blocks_kernel(
    scores_ptr,
    seq_lens_ptr,
    budgets_ptr,
    out_ptr,
    stride_sr,
    stride_sh,
    stride_sp,
    stride_or,
    stride_oh,
    stride_on,
    max_pages,
    width,
    sink,
    local,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (row, kv head); the row's whole page list sits in one tile.
    row = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, BLOCK_N)
    n = (tl.load(seq_lens_ptr + row).to(tl.int64) + PAGE - 1) // PAGE
    k = tl.load(budgets_ptr + row).to(tl.int64)
    # Candidates are the pages in [sink, mid_end); a dense row has none. Row-level conditions stay
    # integers: the interpreter mistypes scalar-bool & tensor-bool.
    mid_end = tl.where(n > k, n - local, sink)
    k_mid = tl.where(n > k, k - sink - local, 0)
    keep = (p < n) & ((p < sink) | (p >= mid_end))
    cand = (p >= sink) & (p < mid_end)

    s = tl.load(scores_ptr + row * stride_sr + head * stride_sh + p * stride_sp, mask=p < max_pages, other=0.0)
    # -0.0 == 0.0 as floats, so they must share a key for ties to break as in the reference.
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    # Order-preserving key: negative floats have their magnitude bits flipped so int order == float order.
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)

    # The k-th largest candidate key is the largest t with count(key >= t) >= k_mid: bisect the int32
    # range; [lo, hi) halves 32 times from a width of 2**32, so it ends at exactly one value. Rows
    # with nothing to choose (dense, or a budget of sink + local) skip it and choose nothing.
    lo = tl.where(k_mid > 0, -(2**31), 2**31 - 1).to(tl.int64)
    hi = tl.full((), 2**31, tl.int64)
    for _ in range(tl.where(k_mid > 0, 32, 0)):
        mid = lo + (hi - lo) // 2
        count = tl.sum((cand & (key >= mid)).to(tl.int32), axis=0)
        enough = count >= k_mid
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    above = cand & (key > lo)
    ties = cand & (key == lo)
    room = k_mid - tl.sum(above.to(tl.int32), axis=0)
    chosen = above | (ties & (tl.cumsum(ties.to(tl.int32), axis=0) <= room))
    selected = keep | chosen

    slot = tl.cumsum(selected.to(tl.int32), axis=0) - 1
    total = tl.sum(selected.to(tl.int32), axis=0)
    base = out_ptr + row * stride_or + head * stride_oh
    tl.store(base + slot * stride_on, p, mask=selected)
    tl.store(base + p * stride_on, tl.full((BLOCK_N,), -1, tl.int32), mask=(p >= total) & (p < width))


def select_blocks_triton(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    budgets: torch.Tensor,
    sink: int = 1,
    local: int = 2,
    bounds: DecodeBounds | None = None,
) -> torch.Tensor:
    """Triton twin of `select_blocks_ref`, selection bit-identical for the same scores.

    Exact top-k per (row, KV head) without sorting: scores map to order-preserving int32 keys, the
    k-th largest key is found by a 32-step bisection of counts, and ties at it go to the lowest page
    indices through a prefix sum. NaN scores are not supported. With `bounds` the output is
    `bounds.width` wide (-1 padded) and nothing is read from the device.
    """
    check_selection_inputs(scores, seq_lens, budgets, sink, local, bounds)
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32, got {scores.dtype}")
    if seq_lens.is_floating_point() or budgets.is_floating_point():
        raise ValueError("seq_lens and budgets must be integer tensors")
    check_same_device(scores=scores, seq_lens=seq_lens, budgets=budgets)
    rows, h, max_pages = scores.shape
    if bounds is not None:
        width = min(bounds.width, max_pages) if rows else 0
    else:
        width = int(torch.minimum(num_pages(seq_lens.long()), budgets.long()).max()) if rows else 0
    out = torch.empty(rows, h, width, dtype=torch.int32, device=scores.device)
    if rows == 0 or width == 0:
        return out
    block_n = max(16, triton.next_power_of_2(max_pages))
    _select_blocks_kernel[(rows, h)](
        scores,
        seq_lens,
        budgets,
        out,
        *scores.stride(),
        *out.stride(),
        max_pages,
        width,
        sink,
        local,
        PAGE=PAGE_SIZE,
        BLOCK_N=block_n,
        num_warps=4 if block_n <= 2048 else 8 if block_n <= 8192 else 16,
    )
    return out


def score_blocks(
    q: torch.Tensor,
    centroids: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    backend: str = "auto",
    bounds: DecodeBounds | None = None,
    budgets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores [rows, kv_heads, max_pages] float32 of every page; see `score_blocks_ref` and `resolve_backend`.

    The backends sum the dot products in different orders, so near-ties may rank differently:
    whoever must reproduce another's selection (trainer vs engine) uses the same backend.
    `bounds` and `budgets` reach the Triton kernel only (the others run where reading lengths costs
    no sync); see `score_blocks_triton`: with `budgets`, rows the selection takes whole are -inf there.
    """
    which = resolve_backend(backend, q)
    if which == "cpu":
        from .cpu import score_blocks_cpu

        return score_blocks_cpu(q, centroids, k_cache, block_table, seq_lens)
    if which == "triton":
        return score_blocks_triton(q, centroids, k_cache, block_table, seq_lens, bounds, budgets)
    return score_blocks_ref(q, centroids, k_cache, block_table, seq_lens)


def select_blocks(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    budgets: torch.Tensor,
    sink: int = 1,
    local: int = 2,
    backend: str = "auto",
    bounds: DecodeBounds | None = None,
) -> torch.Tensor:
    """Selected page indices int32 [rows, kv_heads, width], ascending, -1 padded; budgets in pages.

    `bounds` reach the Triton kernel only, as in `score_blocks`."""
    which = resolve_backend(backend, scores)
    if which == "cpu":
        from .cpu import select_blocks_cpu

        return select_blocks_cpu(scores, seq_lens, budgets, sink, local)
    if which == "triton":
        return select_blocks_triton(scores, seq_lens, budgets, sink, local, bounds)
    return select_blocks_ref(scores, seq_lens, budgets, sink, local)
