"""The CUDA attention backend with block-sparse decode: vLLM's Triton backend, our decode inside.

Registered in place of `TRITON_ATTN`, which the engine asks for on CUDA
(`services.generator.plugin.engine_attention_backend`). The KV cache stays vLLM's, written by the
stock `do_kv_cache_update`: each layer's tensor is the logical view
`[num_blocks, kv_heads, block_size, 2 * head_dim]`, keys in the first half of the last dimension and
values in the second, in the physical order of the resolved KV cache layout (NHD by default). Its
two halves are `[num_blocks, kv_heads, block_size, head_dim]` strided views, the layout `kernels`
read with whatever strides: the cache is read in place, never copied.

Per step, in `forward`:
  1. the centroids of the pages the step wrote are recomputed from `slot_mapping`
     (`PageCentroids`), in every layer, so that a schedule set later finds them current;
  2. decode rows (one query token; the builder has vLLM put them first) run `decode_rows`: the
     schedule's budget at each row's length, scoring, selection and attention by our Triton kernels;
  3. the remaining rows (prefill chunks) run the stock Triton attention on a slice of the metadata.
With no schedule, or in a dense layer, the whole step is the stock forward: dense decode is vLLM's.

CUDA graphs: the builder declares `AttentionCGSupport.NEVER`, so vLLM turns its default
FULL_AND_PIECEWISE into PIECEWISE: the layers between attentions replay as captured graphs and
attention runs eagerly (vLLM refuses an explicit FULL mode with a message). Full graphs cannot hold
this decode as written: the kernel wrappers size their outputs (score width, selection width) from
the step's lengths, and a graph would replay the sizes of its capture. Those sizes come from the
host, not the device: the builder keeps the decode rows' lengths from vLLM's CPU copy
(`decode_seq_lens_cpu`), and the decode reads nothing back from the GPU (no host sync) in a step
of decodes; a step with prefill chunks pays one, finding the pages the chunks wrote, once for all
layers (they share the step's metadata, which keeps the answer).

Memory: the centroid tables (float32, one row per 16 tokens of cache) are allocated on the first
forward, outside vLLM's KV budget: about 1/16 of the KV cache's bytes in bf16, 1/32 in float32.
Leave that much headroom under `gpu_memory_utilization`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from kernels import Workspace
from services.generator.plugin.page_centroids import PageCentroids, page_ends
from services.generator.plugin.scheduled_decode import ScheduledDecode, layer_index_of, refuse_unsupported


@dataclass
class SparrowTritonMetadata(TritonAttentionMetadata):
    """The stock metadata plus where the decode rows (a prefix of the batch) end."""

    num_decodes: int = 0
    num_decode_tokens: int = 0
    decode_seq_lens_cpu: torch.Tensor | None = None  # the decode rows' lengths on the host
    page_end_slots: torch.Tensor | None = None  # `page_ends` of the step's slots, found by its first layer


def with_decode_split(
    metadata: TritonAttentionMetadata, common: CommonAttentionMetadata, cpu_lens_exact: bool = True
) -> SparrowTritonMetadata:
    """`metadata` with the batch's decode rows counted (host-side, from the CPU copy of query_start_loc)
    and their lengths on the host: vLLM's CPU copy where it is exact (`cpu_lens_exact`: it is but for
    speculative decoding, where it may run ahead), else read from the device, once per step."""
    num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(common, decode_threshold=1)
    values = {f.name: getattr(metadata, f.name) for f in fields(TritonAttentionMetadata)}
    lens = common.seq_lens_cpu_upper_bound
    if lens is None or not cpu_lens_exact:
        lens_cpu = common.seq_lens[:num_decodes].cpu()
    else:
        lens_cpu = lens[:num_decodes]
    return SparrowTritonMetadata(
        **values, num_decodes=num_decodes, num_decode_tokens=num_decode_tokens, decode_seq_lens_cpu=lens_cpu
    )


def prefill_rows(metadata: SparrowTritonMetadata) -> SparrowTritonMetadata:
    """The metadata of the rows after the decode rows, as a batch of its own (views, no copies of note)."""
    d, dt = metadata.num_decodes, metadata.num_decode_tokens
    rows = metadata.query_start_loc.shape[0] - 1  # the rows query_start_loc describes, none beyond
    causal = metadata.causal[d:rows] if isinstance(metadata.causal, torch.Tensor) else metadata.causal
    return replace(
        metadata,
        num_actual_tokens=metadata.num_actual_tokens - dt,
        query_start_loc=metadata.query_start_loc[d:] - dt,
        seq_lens=metadata.seq_lens[d:rows],
        block_table=metadata.block_table[d:rows],
        slot_mapping=metadata.slot_mapping[dt:],
        causal=causal,
        num_decodes=0,
        num_decode_tokens=0,
        decode_seq_lens_cpu=None,
        page_end_slots=None,
    )


def key_value_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of a layer's cache, each [num_blocks, kv_heads, block_size, head_size]."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise RuntimeError(
            f"sparrow attention expects a KV cache view [num_blocks, kv_heads, block_size, {2 * head_size}], "
            f"got {tuple(kv_cache.shape)}"
        )
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


class SparrowTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    """Stock metadata, decode rows first, and no full CUDA graphs (see the module doc)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # vLLM then orders each batch decode rows first, so they are a prefix the impl slices off.
        self._init_reorder_batch_threshold(1)
        self.supports_draft_decode_metadata_update = False
        self.cpu_lens_exact = vllm_config.speculative_config is None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> SparrowTritonMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return with_decode_split(metadata, common_attn_metadata, self.cpu_lens_exact)


class SparrowTritonAttentionImpl(ScheduledDecode, TritonAttentionImpl):
    """Stock Triton attention for prefill, block-sparse decode under the schedule (see the module doc)."""

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
        use_alibi_sqrt: bool = False,
        chunk_lookback: int = -1,
    ) -> None:
        refuse_unsupported(
            alibi_slopes,
            sliding_window,
            logits_soft_cap,
            kv_cache_dtype,
            attn_type,
            kv_sharing_target_layer_name,
            sinks,
            **{"square-root ALiBi": use_alibi_sqrt, "chunked local attention": chunk_lookback != -1},
        )
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            sinks,
        )
        self.supports_quant_query_input = False
        self.backend = "triton"
        self.workspace = Workspace()
        self.page_centroids: PageCentroids | None = None

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: SparrowTritonMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by sparrow attention")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        if self.layer_index is None:
            self.layer_index = layer_index_of(layer.layer_name)
        k_cache, v_cache = key_value_views(kv_cache, self.head_size)
        if self.page_centroids is None or not self.page_centroids.fits(k_cache):
            self.page_centroids = PageCentroids(k_cache)
            self.centroids = self.page_centroids.table
        tokens = attn_metadata.num_actual_tokens
        decodes, decode_tokens = attn_metadata.num_decodes, attn_metadata.num_decode_tokens
        slots = attn_metadata.slot_mapping[:tokens]
        if decode_tokens < tokens:  # prefill chunks: the last token written to each page (a host sync)
            if attn_metadata.page_end_slots is None:
                attn_metadata.page_end_slots = page_ends(slots)
            slots = attn_metadata.page_end_slots
        self.page_centroids.refresh(k_cache, slots, one_token_per_page=True)
        if decodes == 0 or self.decodes_densely():
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)

        q = query[:decodes].view(decodes, self.num_heads, self.head_size)
        out = output[:decodes].view(decodes, self.num_heads, self.head_size)
        block_table, seq_lens = attn_metadata.block_table[:decodes], attn_metadata.seq_lens[:decodes]
        lens_cpu = attn_metadata.decode_seq_lens_cpu
        out.copy_(self.decode_rows(q, k_cache, v_cache, block_table, seq_lens, seq_lens_cpu=lens_cpu))
        if decode_tokens < tokens:
            rest = slice(decode_tokens, None)
            super().forward(
                layer, query[rest], key[rest], value[rest], kv_cache, prefill_rows(attn_metadata), output[rest]
            )
        return output


class SparrowTritonAttentionBackend(TritonAttentionBackend):
    """TRITON_ATTN with the project's block-sparse decode (registered in its place by the plugin).

    It claims only what the impl computes: causal decoder self-attention, an unquantized KV cache,
    no sliding window, sinks, ALiBi or multimodal prefix; vLLM's backend check names what a model
    needs beyond that.
    """

    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_impl_cls() -> type[SparrowTritonAttentionImpl]:
        return SparrowTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SparrowTritonMetadataBuilder]:
        return SparrowTritonMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False
