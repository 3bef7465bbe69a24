"""Attention of one layer inside vLLM: KV writes, centroid upkeep, dense prefill, block-sparse decode.

The layer's cache tensor (allocated by vLLM, `[num_blocks, kv_heads, block_size, 2 * head_dim]`,
contiguous) is reinterpreted as two contiguous halves, keys then values, each
`[num_blocks, kv_heads, block_size, head_dim]`: the layout of `kernels.layout`, so that the CPU
extension and the Triton kernels read it in place without a copy. Nothing else in vLLM reads the
bytes of the cache on this path (no stock kernel, no KV transfer), which is what makes the layout
ours to choose.

Per step (`forward`, after `do_kv_cache_update` wrote the step's keys and values):
  1. centroids of the pages the step wrote are recomputed (one page per decoding row);
  2. rows with more than one query token (prefill chunks, speculative verifies) attend densely and causally
     from their offset: short ones in place through `kernels.paged_prefill_attention` (each page read once for
     all of a row's tokens), long ones with torch SDPA over their prefix copied out of the pages;
  3. rows with one query token decode: densely in the schedule's dense layers, when there is no
     schedule, or when the row is short; otherwise with the schedule's budget at the row's length
     (sink + local + top-k pages by centroid score), batched across rows and heads.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from kernels import PAGE_SIZE, new_centroids, paged_prefill_attention, update_centroids
from services.generator.plugin.scheduled_decode import ScheduledDecode, layer_index_of, refuse_unsupported
from services.generator.plugin.self_draft import DRAFTING, SELF_DRAFT

__all__ = ["SparrowAttentionImpl", "layer_index_of", "split_kv_cache"]

IN_PLACE_QUERY_TOKENS = 64
"""rows with at most this many query tokens (a speculative verify has k + 1 <= 17) attend through the paged
prefill kernel in place; longer prefill chunks copy their prefix out for SDPA"""


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of a layer's cache tensor, each [num_blocks, kv_heads, block_size, head_dim]."""
    if not kv_cache.is_contiguous():
        raise RuntimeError("sparrow attention needs each layer's KV cache tensor to be contiguous")
    nb, h, bs, d2 = kv_cache.shape
    halves = kv_cache.view(2, nb, h, bs, d2 // 2)
    return halves[0], halves[1]


def _self_drafting_engine() -> bool:
    """Whether the engine being built drafts for itself (`self_draft`): its layers then decode densely but in drafts."""
    from vllm.config import get_current_vllm_config

    try:
        config = get_current_vllm_config()
    except (AssertionError, RuntimeError):  # a layer made outside an engine (tests, benches)
        return False
    return bool((config.additional_config or {}).get(SELF_DRAFT)) and config.speculative_config is not None


class SparrowAttentionImpl(ScheduledDecode, AttentionImpl):
    """Decoder self-attention with block-sparse decode under a runtime-settable schedule."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        refuse_unsupported(
            alibi_slopes,
            sliding_window,
            logits_soft_cap,
            kv_cache_dtype,
            attn_type,
            kv_sharing_target_layer_name,
            sinks,
        )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = None
        self.speculative = _self_drafting_engine()

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        k_cache, v_cache = split_kv_cache(kv_cache)
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        key, value = key[:n], value[:n]
        if bool((slots < 0).any()):  # padding tokens carry slot -1
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        bs = k_cache.shape[2]
        blocks, offsets = slots // bs, slots % bs
        k_cache[blocks, :, offsets] = key.to(k_cache.dtype)
        v_cache[blocks, :, offsets] = value.to(v_cache.dtype)

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by sparrow attention")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        if self.layer_index is None:
            self.layer_index = layer_index_of(layer.layer_name)
        # Speculative: the target's forwards (verify, prefill, rows without drafts) attend densely, drafts sparsely.
        self.forward_dense = self.speculative and not getattr(attn_metadata, DRAFTING, False)
        k_cache, v_cache = split_kv_cache(kv_cache)
        if self.centroids is None or self.centroids.shape[0] != k_cache.shape[0]:
            self.centroids = new_centroids(k_cache)

        seq_lens = attn_metadata.seq_lens.long()
        rows = seq_lens.shape[0]
        starts = attn_metadata.query_start_loc[: rows + 1].long()
        q_lens = starts[1:] - starts[:-1]
        block_table = attn_metadata.block_table[:rows]
        tokens = attn_metadata.num_actual_tokens
        q = query[:tokens].view(tokens, self.num_heads, self.head_size)
        out = output[:tokens].view(tokens, self.num_heads, self.head_size)

        if tokens == rows:  # every row decodes one token (the steady state): one page each to refresh
            if k_cache.device.type == "cpu":
                self._refresh_last_pages(k_cache, block_table, seq_lens)
            else:
                update_centroids(k_cache, self.centroids, block_table, seq_lens, seq_lens - 1, backend=self.backend)
            out.copy_(self.decode_rows(q, k_cache, v_cache, block_table, seq_lens))
            return output
        update_centroids(k_cache, self.centroids, block_table, seq_lens, seq_lens - q_lens, backend=self.backend)
        decoding = (q_lens == 1).nonzero().squeeze(1)
        if decoding.numel():
            at = starts[decoding]
            out[at] = self.decode_rows(q[at], k_cache, v_cache, block_table[decoding], seq_lens[decoding], decoding)
        multi = (q_lens > 1).nonzero().squeeze(1)
        if multi.numel():
            self._prefill_rows(q, out, k_cache, v_cache, block_table, seq_lens, starts, q_lens, multi)
        return output

    def _prefill_rows(self, q, out, k_cache, v_cache, block_table, seq_lens, starts, q_lens, rows) -> None:
        # Short rows (a verify's k + 1 tokens) attend in place, each page read once for all of a row's tokens
        # (`sparrow bench attention --verify-tokens 7`, cold caches as in an engine: 1.0x the copy at 2 KV heads
        # of 16, 2.7x at Qwen3's 8 of 128); long prefill chunks copy their prefix out for SDPA's matrix products.
        in_place = q_lens[rows] <= IN_PLACE_QUERY_TOKENS
        for chosen, backend in ((rows[in_place], self.backend), (rows[~in_place], "torch")):
            if not chosen.numel():
                continue
            at = torch.cat([torch.arange(int(starts[r]), int(starts[r + 1])) for r in chosen.tolist()]).to(q.device)
            sub_starts = torch.zeros(chosen.numel() + 1, dtype=torch.int64)
            sub_starts[1:] = q_lens[chosen].cpu().cumsum(0)
            out[at] = paged_prefill_attention(
                q[at], k_cache, v_cache, block_table[chosen], seq_lens[chosen], sub_starts.to(q.device), self.scale,
                backend=backend,
            )  # fmt: skip

    def _refresh_last_pages(self, k_cache, block_table, seq_lens) -> None:
        # `kernels.update_centroids_ref` for exactly one written token per row, without its generality
        # (it dominated the step on CPU). Same arithmetic, so the same centroids as the trainer's.
        nb, h, bs, d = k_cache.shape
        pos = seq_lens - 1
        page = torch.div(pos, PAGE_SIZE, rounding_mode="floor")
        blocks = block_table.gather(1, torch.div(page * PAGE_SIZE, bs, rounding_mode="floor")[:, None])[:, 0].long()
        slots = torch.div(page * PAGE_SIZE % bs, PAGE_SIZE, rounding_mode="floor")
        keys = k_cache.view(nb, h, bs // PAGE_SIZE, PAGE_SIZE, d)[blocks, :, slots].float()  # [rows, h, 16, d]
        filled = pos - page * PAGE_SIZE + 1
        mask = torch.arange(PAGE_SIZE, device=keys.device)[None, :] < filled[:, None]
        self.centroids[blocks, :, slots] = (keys * mask[:, None, :, None]).sum(dim=2) / filled[:, None, None].float()
