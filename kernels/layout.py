"""The paged KV-cache layout every kernel in this package shares, and the checks on it.

Layout (one layer):
    k_cache, v_cache   [num_blocks, num_kv_heads, block_size, head_dim]   block_size a multiple of PAGE_SIZE
    centroids          [num_blocks, num_kv_heads, block_size // PAGE_SIZE, head_dim]   float32
    block_table        [num_rows, max_blocks_per_row]   int32/int64, cache block of each logical block
    seq_lens           [num_rows]   tokens cached for the row, the current (decoding) token included

A "page" is the 16-token unit of block selection; an engine block may hold several pages.
Page p of a row lives in cache block block_table[row, p * PAGE_SIZE // block_size] at page slot
(p * PAGE_SIZE % block_size) // PAGE_SIZE.
"""

from __future__ import annotations

import torch

from .pages import PAGE_SIZE


def check_budgets(budgets: torch.Tensor | None, seq_lens: torch.Tensor) -> None:
    """Raise ValueError unless `budgets` (None: not given) are integers, one per row of `seq_lens`."""
    if budgets is not None and (budgets.shape != seq_lens.shape or budgets.is_floating_point()):
        raise ValueError(f"budgets must be integers shaped like seq_lens {tuple(seq_lens.shape)}")


def check_paged_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int | None = None,
) -> None:
    """Raise ValueError with a clear message when the cache tensors do not fit the layout above.

    `max_seq_len`, a bound on `seq_lens` the caller knows on the host (`DecodeBounds`), replaces
    reading the lengths from the device: the row-length checks are then the caller's.
    """
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, kv_heads, block_size, head_dim], got shape {tuple(k_cache.shape)}"
        )
    if v_cache is not None and v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    block_size = k_cache.shape[2]
    if block_size % PAGE_SIZE != 0:
        raise ValueError(f"cache block size {block_size} is not a multiple of the page size {PAGE_SIZE}")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table must be a 2-D int32/int64 tensor, got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(
            f"seq_lens must be 1-D with one entry per block_table row ({block_table.shape[0]}), "
            f"got {tuple(seq_lens.shape)}"
        )
    if max_seq_len is not None:
        if max_seq_len > block_table.shape[1] * block_size:
            raise ValueError(
                f"a row holds up to {max_seq_len} tokens but block_table has room for "
                f"{block_table.shape[1] * block_size}"
            )
        return
    if seq_lens.numel() and int(seq_lens.max()) > block_table.shape[1] * block_size:
        raise ValueError(
            f"a row holds {int(seq_lens.max())} tokens but block_table has room for {block_table.shape[1] * block_size}"
        )
    if seq_lens.numel() and int(seq_lens.min()) < 1:
        raise ValueError("every row must hold at least one cached token")


def check_centroids(centroids: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Raise ValueError unless `centroids` has the shape the cache `k_cache` implies."""
    nb, h, bs, d = k_cache.shape
    want = (nb, h, bs // PAGE_SIZE, d)
    if tuple(centroids.shape) != want:
        raise ValueError(f"centroids must have shape {want} for this cache, got {tuple(centroids.shape)}")


def page_location(block_table: torch.Tensor, pages: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache block and in-block page slot of logical `pages` ([rows, n], any value >= 0) of each row."""
    per_block = block_size // PAGE_SIZE
    blocks = torch.gather(block_table.long(), 1, pages // per_block)
    return blocks, pages % per_block


def flat_page_index(block_table: torch.Tensor, pages: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Index of (row, kv head, page) into a cache viewed as [num_blocks * kv_heads * pages_per_block, ...].

    `pages` is [rows, kv_heads, n] of logical page numbers (>= 0); the result has the same shape.
    """
    rows, h, n = pages.shape
    blocks, slots = page_location(block_table, pages.reshape(rows, h * n), block_size)
    per_block = block_size // PAGE_SIZE
    heads = torch.arange(h, device=pages.device).repeat_interleave(n)[None, :]
    return ((blocks * num_kv_heads + heads) * per_block + slots).view(rows, h, n)
