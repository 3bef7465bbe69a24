"""Page centroids of one layer, indexed by cache block and kept current from the slots written each step.

vLLM writes a step's keys at `slot_mapping` (slot = block * block_size + offset, -1 for padding
tokens). A page's centroid is the mean of its filled keys, so after a step only the pages written
to change, and each is recomputed from the cache in full (at most 16 keys) from the last token
written to it: no running sums to drift, and the same arithmetic as `kernels.update_centroids_ref`.
The table is indexed by vLLM's block id, so it follows the block table, prefix-cache hits included
(a cached block's keys, hence its centroids, are unchanged since they were written).

vLLM-free (torch and `kernels` only) so that it can be checked on a GPU machine without vLLM.
"""

from __future__ import annotations

import torch

from kernels import PAGE_SIZE, resolve_backend, update_centroids_at_slots_triton


class PageCentroids:
    """Float32 centroids [num_blocks, kv_heads, block_size // 16, head_dim] of a paged key cache.

    One extra block at the end of the buffer takes the writes that must land nowhere (padding
    slots), which keeps the pure-decode update free of host syncs. `backend` "auto" updates with
    one Triton kernel on a GPU (`kernels.update_centroids_at_slots_triton`) and with torch
    elsewhere; "triton" or "torch" choose.
    """

    def __init__(self, k_cache: torch.Tensor, backend: str = "auto") -> None:
        nb, h, bs, d = k_cache.shape
        if bs % PAGE_SIZE:
            raise ValueError(f"cache block size {bs} is not a multiple of the page size {PAGE_SIZE}")
        self._buffer = torch.zeros(nb + 1, h, bs // PAGE_SIZE, d, dtype=torch.float32, device=k_cache.device)
        self.table = self._buffer[:nb]
        self.triton = resolve_backend(backend, k_cache) == "triton"

    def fits(self, k_cache: torch.Tensor) -> bool:
        """Whether this table belongs to a cache of `k_cache`'s shape and device."""
        nb, h, bs, d = k_cache.shape
        return self.table.shape == (nb, h, bs // PAGE_SIZE, d) and self.table.device == k_cache.device

    def refresh(self, k_cache: torch.Tensor, slots: torch.Tensor, one_token_per_page: bool = False) -> None:
        """Recompute the centroid of every page a token of `slots` was written to, from `k_cache`.

        `k_cache` is [num_blocks, kv_heads, block_size, head_dim] with any strides (vLLM's key view).
        `one_token_per_page` (no two of `slots` share a page, as in a step of pure decodes or the
        `page_ends` of a step's slots) skips finding each page's last token, and with it a host sync.
        """
        nb, h, bs, d = k_cache.shape
        if not one_token_per_page:
            slots = page_ends(slots)
        if self.triton:
            update_centroids_at_slots_triton(k_cache, self.table, slots)
            return
        slots = slots.long()
        live = slots >= 0
        slot = slots.clamp(min=0)
        first = slot - slot % PAGE_SIZE
        block = torch.div(first, bs, rounding_mode="floor")
        in_block = first % bs
        offsets = torch.arange(PAGE_SIZE, device=slots.device)
        keys = k_cache[block[:, None], :, in_block[:, None] + offsets].float()  # [n, PAGE_SIZE, h, d]
        filled = slot % PAGE_SIZE + 1
        mask = offsets[None, :] < filled[:, None]
        sums = (keys * mask[:, :, None, None]).sum(dim=1)
        target = torch.where(live, block, torch.full_like(block, nb))
        self._buffer[target, :, torch.div(in_block, PAGE_SIZE, rounding_mode="floor")] = (
            sums / filled[:, None, None].float()
        )


def page_ends(slots: torch.Tensor) -> torch.Tensor:
    """The slots among `slots` that are the last written to their page in this step (padding dropped).

    A request's tokens of one step sit side by side with consecutive slots, and a partial page
    belongs to one request: a token is its page's last when the next token is in another page.
    Writing only these keeps one writer per page (a GPU scatter with repeats has no set order).
    Boolean indexing: one host sync.
    """
    slots = slots.long()
    page = torch.div(slots, PAGE_SIZE, rounding_mode="floor")
    next_page = torch.cat((page[1:], page.new_full((1,), -1)))
    return slots[(slots >= 0) & (next_page != page)]
