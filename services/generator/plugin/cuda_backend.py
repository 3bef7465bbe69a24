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

CUDA graphs, two ways:
  - by default the builder declares `AttentionCGSupport.NEVER`, so vLLM turns its default
    FULL_AND_PIECEWISE into PIECEWISE: the layers between attentions replay as captured graphs and
    attention runs eagerly. The kernels' sizes then fit each step's lengths, which come from the
    host: the builder keeps the decode rows' lengths from vLLM's CPU copy (`decode_seq_lens_cpu`),
    and a step of decodes reads nothing back from the GPU (no host sync); a step with prefill chunks
    pays one, finding the pages the chunks wrote, once for all layers (they share the step's
    metadata, which keeps the answer).
  - with static decode on (`additional_config={STATIC_DECODE: True}`) the builder declares
    UNIFORM_SINGLE_TOKEN_DECODE, and vLLM captures whole steps of pure decodes as full graphs
    (steps with prefill chunks stay piecewise). Such a step takes `ScheduledDecode.static_decode_rows`
    in every layer, dense ones and no schedule included: sizes of the longest sequence the engine
    admits, budgets looked up on the device, probe rows from a device mask the builder writes before
    each step (`ProbeRows`), so that one capture serves every later step and schedule. vLLM pads such
    a batch to the graph's size with rows of length 0 and slot -1, which attend to nothing and
    write nowhere. The builder makes every layer's page centroids and tables on its first build
    after the KV caches are bound (`prepare_static_layers`), before vLLM captures anything: made
    inside a capture, their allocation and zeroing would be replayed at every step, so a capture
    that finds none refuses (RuntimeError). Scratch memory is each call's own, which a graph keeps.

Memory: the centroid tables (float32, one row per 16 tokens of cache) are allocated on the first
forward, outside vLLM's KV budget: about 1/16 of the KV cache's bytes in bf16, 1/32 in float32.
Leave that much headroom under `gpu_memory_utilization`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

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
from services.generator.plugin import STATIC_DECODE
from services.generator.plugin.decode_context import DecodeContext
from services.generator.plugin.page_centroids import PageCentroids, page_ends
from services.generator.plugin.scheduled_decode import (
    ProbeRows,
    ScheduledDecode,
    capturing,
    layer_index_of,
    refuse_unsupported,
)


def static_decode_enabled(vllm_config) -> bool:
    """Whether the engine asked for static decode (see the module doc)."""
    extra = getattr(vllm_config, "additional_config", None)
    return isinstance(extra, dict) and bool(extra.get(STATIC_DECODE, False))


@dataclass
class SparrowTritonMetadata(TritonAttentionMetadata):
    """The stock metadata plus where the decode rows (a prefix of the batch) end."""

    num_decodes: int = 0
    num_decode_tokens: int = 0
    decode_seq_lens_cpu: torch.Tensor | None = None  # the decode rows' lengths on the host
    page_end_slots: torch.Tensor | None = None  # `page_ends` of the step's slots, found by its first layer
    # Static decode (a step of pure decodes only): the engine's longest sequence and the probe-row mask.
    static_max_seq_len: int | None = None
    probe_rows: torch.Tensor | None = None
    dense_rows: torch.Tensor | None = None  # rows of dense requests (ProbeRows.dense)


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


def with_static_decode(
    metadata: SparrowTritonMetadata, max_seq_len: int, probe_rows: ProbeRows, context: DecodeContext
) -> SparrowTritonMetadata:
    """`metadata` of a step of pure decodes marked for static decode, the probe-row mask written
    (when a probe plan is set in the layers' `context`); other steps unchanged. Runs in the builder,
    outside any graph: a replay reads the mask written here, at the address its capture read."""
    if metadata.num_decode_tokens != metadata.num_actual_tokens:
        return metadata
    ids = context.current_probe_row_ids()
    if ids is not None:
        probe_rows.write(ids[: metadata.num_decodes])
    dense_ids = context.current_dense_row_ids()
    if dense_ids is not None:
        probe_rows.write_dense(dense_ids[: metadata.num_decodes])
    return replace(metadata, static_max_seq_len=max_seq_len, probe_rows=probe_rows.mask, dense_rows=probe_rows.dense)


def prepare_static_layers(layers: Mapping[str, Any], max_seq_len: int) -> bool:
    """Make every layer's page centroids and static-decode tables, once its KV cache is bound.

    Runs in the builder, outside any graph, before the first step a graph captures: made inside a
    capture, their allocation and first fill would be replayed at every step (zeroed centroids).
    `layers`: vLLM's attention layers by name (its static forward context). Returns whether there
    were layers of ours and each had its cache (vLLM binds the caches after it makes the builders)."""
    ready, prepared = True, 0
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        if not isinstance(impl, SparrowTritonAttentionImpl):
            continue
        kv_cache = getattr(layer, "kv_cache", None)
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4:
            ready = False
            continue
        impl.prepare_static(name, kv_cache, max_seq_len)
        prepared += 1
    return ready and prepared > 0


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
        static_max_seq_len=None,
        probe_rows=None,
        dense_rows=None,
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
    """Stock metadata, decode rows first; full CUDA graphs of pure-decode steps with static decode only
    (see the module doc)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if static_decode_enabled(vllm_config):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # vLLM then orders each batch decode rows first, so they are a prefix the impl slices off.
        self._init_reorder_batch_threshold(1)
        self.supports_draft_decode_metadata_update = False
        self.cpu_lens_exact = vllm_config.speculative_config is None
        self.static_max_seq_len: int | None = None
        self.probe_rows: ProbeRows | None = None
        self.static_prepared = False
        if static_decode_enabled(vllm_config):
            self.static_max_seq_len = vllm_config.model_config.max_model_len
            sched = vllm_config.scheduler_config  # a graph's batch is at most this many rows
            self.probe_rows = ProbeRows(max(sched.max_num_seqs, sched.max_num_batched_tokens), device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> SparrowTritonMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata = with_decode_split(metadata, common_attn_metadata, self.cpu_lens_exact)
        if self.probe_rows is not None:
            if not self.static_prepared:
                context = self.vllm_config.compilation_config.static_forward_context
                layers = {name: context[name] for name in self.layer_names if name in context}
                self.static_prepared = prepare_static_layers(layers, self.static_max_seq_len)
            metadata = with_static_decode(metadata, self.static_max_seq_len, self.probe_rows, self.decode_context())
        return metadata

    def decode_context(self) -> DecodeContext:
        """The decode context of this builder's layers: their worker's, once it has handed it to them
        (after the builders are made), read at every step."""
        layers = self.vllm_config.compilation_config.static_forward_context
        for name in self.layer_names:
            impl = getattr(layers.get(name), "impl", None)
            if isinstance(impl, ScheduledDecode):
                return impl.context
        return DecodeContext()


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
        self._ensure_centroids(k_cache)
        tokens = attn_metadata.num_actual_tokens
        decodes, decode_tokens = attn_metadata.num_decodes, attn_metadata.num_decode_tokens
        if attn_metadata.static_max_seq_len is not None:
            return self._static_forward(query, k_cache, v_cache, attn_metadata, output)
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

    def _ensure_centroids(self, k_cache: torch.Tensor) -> None:
        """The page-centroid table of this cache, made on first use (never inside a CUDA graph)."""
        if self.page_centroids is not None and self.page_centroids.fits(k_cache):
            return
        if capturing():
            raise RuntimeError(
                "page centroids must be made before a CUDA graph captures a step: inside one, their "
                "zeroing would be replayed at every step (the builder makes them: prepare_static_layers)"
            )
        self.page_centroids = PageCentroids(k_cache)
        self.centroids = self.page_centroids.table

    def prepare_static(self, layer_name: str, kv_cache: torch.Tensor, max_seq_len: int) -> None:
        """Make this layer's page centroids and static-decode tables now, outside any graph."""
        if self.layer_index is None:
            self.layer_index = layer_index_of(layer_name)
        k_cache, _ = key_value_views(kv_cache, self.head_size)
        self._ensure_centroids(k_cache)
        st = self.static
        if st is None or st.max_seq_len != max_seq_len or st.device != k_cache.device:
            self.make_static_tables(max_seq_len, k_cache.device)

    def _static_forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: SparrowTritonMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """A step of pure decodes as a full CUDA graph replays it (see the module doc): the same
        kernels, sizes and addresses at every step, whatever the lengths, the schedule or the probes."""
        rows = metadata.num_decodes
        self.page_centroids.refresh(
            k_cache, metadata.slot_mapping[: metadata.num_actual_tokens], one_token_per_page=True
        )
        if rows == 0:
            return output
        q = query[:rows].view(rows, self.num_heads, self.head_size)
        out = output[:rows].view(rows, self.num_heads, self.head_size)
        block_table, seq_lens = metadata.block_table[:rows], metadata.seq_lens[:rows]
        probe_rows = metadata.probe_rows[:rows]
        dense_rows = metadata.dense_rows[:rows] if metadata.dense_rows is not None else None
        out.copy_(
            self.static_decode_rows(
                q, k_cache, v_cache, block_table, seq_lens, metadata.static_max_seq_len, probe_rows, dense_rows
            )
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
