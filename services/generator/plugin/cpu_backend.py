"""The CPU attention backend with block-sparse decode: vLLM's CPU backend, our attention inside.

vLLM allocates each layer's KV cache as `[num_blocks, kv_heads, block_size, 2 * head_dim]`. We keep
that allocation but own what goes in it: `kv_cache.view(nb, h, 2 * bs, d)` splits into a K half and
a V half, each `[nb, h, bs, d]` (keys *not* transposed), which is exactly the paged layout of
`kernels.layout`, so our kernels read the cache in place. Because the layout is ours, our impl does
every attention of the layer (prefill with torch SDPA over the row's pages, decode with
`kernels.block_sparse_decode`), and never the stock C++ kernel; this also serves head sizes the
stock kernel refuses (the project's small models use 16).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from services.generator.plugin.self_draft import DRAFTING
from services.generator.plugin.sparse_impl import SparrowAttentionImpl


class SparrowCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """The stock metadata minus the stock kernel's scheduler plan, which our impl never uses."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> CPUAttentionMetadata:
        if self.is_cross_attention or self.is_encoder_only_attention:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        return CPUAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            scheduler_metadata=None,
            causal=bool(m.causal) if not isinstance(m.causal, torch.Tensor) else True,
        )

    def build_for_drafting(self, common_attn_metadata, draft_index: int) -> CPUAttentionMetadata:
        """A self-draft step's metadata (`self_draft`), marked so that the layers decode it under the schedule."""
        metadata = self.build(0, common_attn_metadata, fast_build=True)
        setattr(metadata, DRAFTING, True)
        return metadata


class SparrowCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with the project's block-sparse decode (registered in its place by the plugin)."""

    forward_includes_kv_cache_update: bool = False

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        from vllm.v1.attention.backend import MultipleOf

        return [MultipleOf(16)]

    @staticmethod
    def get_impl_cls() -> type[SparrowAttentionImpl]:
        return SparrowAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SparrowCPUAttentionMetadataBuilder]:
        return SparrowCPUAttentionMetadataBuilder
