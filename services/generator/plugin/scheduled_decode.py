"""What the CPU and the CUDA attention impls share: the schedule, and how a layer decodes under it.

A row with one query token decodes densely when there is no schedule or the layer is one of the
schedule's dense layers; otherwise under the schedule's budget at the row's current KV length
(sink + local + top-k pages by centroid score, `kernels.block_sparse_decode`), every row and KV
head in one batch. A row with no more pages than its budget attends to all of them.

vLLM-free on purpose (torch, `kernels` and the schedule only): the decode path that is ours can then
be checked on a GPU machine without vLLM (`bench/cuda_check.py`).
"""

from __future__ import annotations

import re

import torch

from kernels import Workspace, block_sparse_decode, sparse_decode_attention
from sparrow.schedule import Schedule

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def layer_index_of(layer_name: str) -> int:
    """The decoder layer number in a vLLM layer name like `model.layers.3.self_attn.attn`."""
    m = _LAYER_INDEX.search(layer_name)
    if m is None:
        raise ValueError(f"cannot tell the layer number of attention layer {layer_name!r}")
    return int(m.group(1))


def refuse_unsupported(
    alibi_slopes,
    sliding_window,
    logits_soft_cap,
    kv_cache_dtype: str,
    attn_type,
    kv_sharing_target_layer_name,
    sinks,
    **more: bool,
) -> None:
    """Raise NotImplementedError naming every requested feature the impls cannot compute.

    `more` adds an impl's own refusals, keyed by the name the message gives them.
    """
    attn_type = getattr(attn_type, "value", attn_type)
    features = {
        "ALiBi": alibi_slopes is not None,
        "sliding-window attention": sliding_window is not None,
        "logit soft-capping": bool(logits_soft_cap),
        "attention sinks": sinks is not None,
        f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype != "auto",
        f"attention type {attn_type}": attn_type != "decoder",
        "KV sharing across layers": kv_sharing_target_layer_name is not None,
        **more,
    }
    refused = [name for name, present in features.items() if present]
    if refused:
        raise NotImplementedError(
            f"sparrow block-sparse attention does not support {', '.join(refused)}; "
            "run this model with SPARROW_ATTENTION=stock"
        )


class ScheduledDecode:
    """Mixin of an attention impl: the runtime-settable schedule and block-sparse decode under it.

    The impl sets `scale`, `layer_index` (from the layer name, on the first forward), `centroids`
    (current page centroids of its cache), and may set `backend` and `workspace`.
    """

    scale: float
    schedule: Schedule | None = None
    layer_index: int | None = None
    backend: str = "auto"
    centroids: torch.Tensor | None = None
    workspace: Workspace | None = None
    _budget_table: tuple[Schedule, torch.Tensor] | None = None

    def set_schedule(self, schedule: Schedule | None) -> None:
        """Decode under `schedule` from the next forward on (None: dense)."""
        self.schedule = schedule

    def decodes_densely(self) -> bool:
        """True when this layer decodes every row densely now (no schedule, or a dense layer)."""
        s = self.schedule
        return s is None or self.layer_index in s.dense_layers

    def budget_pages(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """`Schedule.budget_pages` of each row's KV length, from a per-schedule device table (no host sync)."""
        s = self.schedule
        cached = self._budget_table
        if cached is None or cached[0] is not s or cached[1].device != seq_lens.device:
            pages = [b // s.page_size for b in s.budgets]
            cached = (s, torch.tensor(pages, dtype=torch.int64, device=seq_lens.device))
            self._budget_table = cached
        bins = torch.div(seq_lens.long(), s.bin_width, rounding_mode="floor").clamp(max=s.num_bins - 1)
        return cached[1][bins]

    def decode_rows(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Output [rows, q_heads, head_dim] of one query token per row under the schedule (see module doc)."""
        if self.decodes_densely():
            return sparse_decode_attention(
                q, k_cache, v_cache, block_table, seq_lens, None, self.scale, self.workspace, backend=self.backend
            )
        s = self.schedule
        out, _ = block_sparse_decode(
            q,
            k_cache,
            v_cache,
            self.centroids,
            block_table,
            seq_lens,
            self.budget_pages(seq_lens),
            s.sink_blocks,
            s.local_blocks,
            self.scale,
            self.workspace,
            backend=self.backend,
        )
        return out
