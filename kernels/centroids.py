"""Block centroids of a paged KV cache: the mean of each 16-token page's post-RoPE keys.

They are kept up to date as tokens are appended: after the engine writes the keys of positions
[prev_lens, seq_lens) of a row, only the pages those positions touch are recomputed (one page per
row per decode step). A page's centroid is the mean over its filled slots, so a full page's
centroid never changes again. Only full pages are ever scored (partial pages are always local).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import check_same_device, check_unit_stride, resolve_backend
from .layout import check_centroids, check_paged_cache, page_location
from .pages import PAGE_SIZE, num_pages


def new_centroids(k_cache: torch.Tensor) -> torch.Tensor:
    """Zeroed float32 centroid storage for a cache laid out as in `kernels.layout`."""
    nb, h, bs, d = k_cache.shape
    return torch.zeros(nb, h, bs // PAGE_SIZE, d, dtype=torch.float32, device=k_cache.device)


def update_centroids_ref(
    k_cache: torch.Tensor,
    centroids: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    prev_lens: torch.Tensor | None = None,
) -> None:
    """Recompute, in place, the centroids of the pages holding positions [prev_lens, seq_lens) of each row.

    `prev_lens` defaults to zero (every page of every row). Plain torch; runs anywhere.
    """
    check_paged_cache(k_cache, None, block_table, seq_lens)
    check_centroids(centroids, k_cache)
    seq_lens = seq_lens.long()
    prev = torch.zeros_like(seq_lens) if prev_lens is None else prev_lens.long().clamp(max=seq_lens)
    first = torch.div(prev, PAGE_SIZE, rounding_mode="floor")
    first = torch.minimum(first, num_pages(seq_lens) - 1)
    last = num_pages(seq_lens) - 1
    span = int((last - first).max()) + 1 if seq_lens.numel() else 0
    if span <= 0:
        return
    pages = first[:, None] + torch.arange(span, device=seq_lens.device)[None, :]
    valid = pages <= last[:, None]
    pages = torch.where(valid, pages, first[:, None])
    blocks, slots = page_location(block_table, pages, k_cache.shape[2])
    blocks, slots, pages = blocks[valid], slots[valid], pages[valid]
    rows = torch.arange(seq_lens.shape[0], device=seq_lens.device)[:, None].expand_as(valid)[valid]

    nb, h, bs, d = k_cache.shape
    paged = k_cache.view(nb, h, bs // PAGE_SIZE, PAGE_SIZE, d)
    keys = paged[blocks, :, slots].float()  # [n, h, PAGE_SIZE, d]
    filled = (seq_lens[rows] - pages * PAGE_SIZE).clamp(max=PAGE_SIZE)  # [n]
    slot_mask = torch.arange(PAGE_SIZE, device=keys.device)[None, :] < filled[:, None]
    sums = (keys * slot_mask[:, None, :, None]).sum(dim=2)
    centroids[blocks, :, slots] = sums / filled[:, None, None].float()


@triton.jit
def _store_page_centroid(
    k_ptr,
    cent_ptr,
    block,
    head,
    first_tok,
    filled,
    d_end,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_cb,
    stride_ch,
    stride_cp,
    stride_cd,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # The mean of the page's first `filled` keys (from in-block token `first_tok` of cache block
    # `block`) into its centroid slot; `d_end` 0 stores nothing.
    offs_t = tl.arange(0, PAGE)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_t[:, None] < filled) & (offs_d[None, :] < d_end)
    ptrs = (
        k_ptr
        + block * stride_kb
        + head * stride_kh
        + (first_tok + offs_t)[:, None] * stride_kt
        + offs_d[None, :] * stride_kd
    )
    keys = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    centroid = tl.sum(keys, axis=0) / tl.maximum(filled, 1).to(tl.float32)
    out = cent_ptr + block * stride_cb + head * stride_ch + (first_tok // PAGE) * stride_cp + offs_d * stride_cd
    tl.store(out, centroid, mask=offs_d < d_end)


@triton.jit
def _update_centroids_kernel(
    k_ptr,
    cent_ptr,
    table_ptr,
    seq_lens_ptr,
    prev_lens_ptr,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_cb,
    stride_ch,
    stride_cp,
    stride_cd,
    stride_tr,
    stride_tb,
    block_size,
    head_dim,
    HAS_PREV: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (row, j-th page touched by the new positions, kv head).
    row = tl.program_id(0)
    j = tl.program_id(1)
    head = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int64)
    last = (seq_len + PAGE - 1) // PAGE - 1
    if HAS_PREV:
        prev = tl.minimum(tl.load(prev_lens_ptr + row).to(tl.int64), seq_len)
    else:
        prev = seq_len * 0
    page = tl.minimum(prev // PAGE, last) + j
    live = page <= last
    block = tl.load(table_ptr + row * stride_tr + (page * PAGE // block_size) * stride_tb, mask=live, other=0)
    block = block.to(tl.int64)
    first_tok = page * PAGE % block_size
    filled = tl.minimum(seq_len - page * PAGE, PAGE)
    # A program past the row's last page does nothing; as an integer bound rather than a scalar bool
    # because the interpreter mistypes scalar-bool & tensor-bool.
    d_end = tl.where(live, head_dim, 0)
    _store_page_centroid(
        k_ptr, cent_ptr, block, head, first_tok, filled, d_end,
        stride_kb, stride_kh, stride_kt, stride_kd, stride_cb, stride_ch, stride_cp, stride_cd,
        PAGE, BLOCK_D,
    )  # fmt: skip


def update_centroids_triton(
    k_cache: torch.Tensor,
    centroids: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    prev_lens: torch.Tensor | None = None,
) -> None:
    """Triton twin of `update_centroids_ref`: one program per (row, touched page, KV head), in place."""
    check_paged_cache(k_cache, None, block_table, seq_lens)
    check_centroids(centroids, k_cache)
    if centroids.dtype != torch.float32:
        raise ValueError(f"centroids must be float32, got {centroids.dtype}")
    if prev_lens is not None and prev_lens.shape != seq_lens.shape:
        raise ValueError(f"prev_lens {tuple(prev_lens.shape)} and seq_lens {tuple(seq_lens.shape)} must match")
    check_same_device(
        k_cache=k_cache, centroids=centroids, block_table=block_table, seq_lens=seq_lens, prev_lens=prev_lens
    )
    check_unit_stride(k_cache=k_cache, centroids=centroids)
    rows = seq_lens.shape[0]
    if rows == 0:
        return
    # The grid needs the widest span of touched pages; one host sync, as in the reference.
    n = num_pages(seq_lens.long())
    if prev_lens is None:
        span = int(n.max())
    else:
        if int(prev_lens.min()) < 0:
            raise ValueError("prev_lens must be >= 0")
        first = torch.minimum(prev_lens.long().clamp(max=seq_lens.long()) // PAGE_SIZE, n - 1)
        span = int((n - first).max())
    nb, h, bs, d = k_cache.shape
    _update_centroids_kernel[(rows, span, h)](
        k_cache,
        centroids,
        block_table,
        seq_lens,
        seq_lens if prev_lens is None else prev_lens,
        *k_cache.stride(),
        *centroids.stride(),
        *block_table.stride(),
        bs,
        d,
        HAS_PREV=prev_lens is not None,
        PAGE=PAGE_SIZE,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )


@triton.jit
def _centroids_at_slots_kernel(
    k_ptr,
    cent_ptr,
    slots_ptr,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_cb,
    stride_ch,
    stride_cp,
    stride_cd,
    block_size,
    head_dim,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (slot, kv head): the mean of the page's keys up to and including the slot.
    i = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    at = tl.maximum(slot, 0)
    block = at // block_size
    first_tok = at % block_size - at % PAGE
    filled = at % PAGE + 1
    # A padding slot (-1) does nothing; an integer bound, not a scalar bool (see _update_centroids_kernel).
    d_end = tl.where(slot >= 0, head_dim, 0)
    _store_page_centroid(
        k_ptr, cent_ptr, block, head, first_tok, filled, d_end,
        stride_kb, stride_kh, stride_kt, stride_kd, stride_cb, stride_ch, stride_cp, stride_cd,
        PAGE, BLOCK_D,
    )  # fmt: skip


def update_centroids_at_slots_triton(k_cache: torch.Tensor, centroids: torch.Tensor, slots: torch.Tensor) -> None:
    """Recompute, in place, the centroid of the page each of `slots` was written to, from the cache.

    `slots` are cache slots (block * block_size + offset, as vLLM's slot_mapping; -1 is padding and
    skipped), each the last token written to its page, so no two share a page (a step of decodes,
    or `page_ends` of a step's slots): a page's centroid is the mean of its keys up to that slot.
    One launch, nothing read back to the host; the engine's per-step upkeep on a GPU.
    """
    if k_cache.dim() != 4 or k_cache.shape[2] % PAGE_SIZE:
        raise ValueError(
            f"k_cache must be [num_blocks, kv_heads, block_size (a multiple of {PAGE_SIZE}), head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    check_centroids(centroids, k_cache)
    if centroids.dtype != torch.float32:
        raise ValueError(f"centroids must be float32, got {centroids.dtype}")
    if slots.dim() != 1 or slots.is_floating_point():
        raise ValueError(f"slots must be a 1-D integer tensor, got {slots.dtype} {tuple(slots.shape)}")
    check_same_device(k_cache=k_cache, centroids=centroids, slots=slots)
    check_unit_stride(k_cache=k_cache, centroids=centroids)
    if slots.numel() == 0:
        return
    _, h, bs, d = k_cache.shape
    _centroids_at_slots_kernel[(slots.shape[0], h)](
        k_cache,
        centroids,
        slots,
        *k_cache.stride(),
        *centroids.stride(),
        bs,
        d,
        PAGE=PAGE_SIZE,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )


def update_centroids(
    k_cache: torch.Tensor,
    centroids: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    prev_lens: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Recompute, in place, the centroids of the pages holding positions [prev_lens, seq_lens) of each row.

    `backend`: see `kernels.backend.resolve_backend`. The CPU backend runs the torch reference here:
    one page per row per step is too little work for an extension to matter.
    """
    impl = update_centroids_triton if resolve_backend(backend, k_cache) == "triton" else update_centroids_ref
    impl(k_cache, centroids, block_table, seq_lens, prev_lens)
