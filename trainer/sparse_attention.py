"""The project's block-sparse attention inside a plain transformers model, through its attention interface.

One attention function is registered under `ATTN_IMPLEMENTATION`; a model loaded (or switched) to it
runs, per forward call, one of three things, chosen by keyword arguments of that call (transformers
hands unknown forward kwargs down to the attention function):
  - nothing extra: stock SDPA with stock masks, so the dense policy is bit-for-bit the `sdpa` model;
  - `sparrow_plan=TeacherForcedPlan(...)`: teacher-forced block-sparse attention in every layer not in
    the plan's dense layers, each position under its own budget (`kernels.teacher_forced_attention`);
  - `sparrow_cache=<object with .attention(module, query, key, value, scaling)>`: the object attends
    itself (the reference decode loop keeps a paged KV cache this way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sparrow.schedule import Schedule

ATTN_IMPLEMENTATION = "sparrow_block_sparse"


@dataclass(frozen=True)
class TeacherForcedPlan:
    """Budgets of one teacher-forced forward: `budgets` [batch, seq] in pages, position t under budgets[:, t]."""

    budgets: torch.Tensor
    sink: int = 1
    local: int = 2
    dense_layers: frozenset[int] = frozenset({0, 1})
    backend: str = "auto"


def teacher_forced_plan(
    schedule: Schedule, prompt_lens: torch.Tensor, seq_len: int, backend: str = "auto"
) -> TeacherForcedPlan:
    """The plan that reproduces decoding under `schedule` for right-padded sequences of `seq_len` positions.

    Position t of a row has KV length t + 1 when it is decoded, so its budget is
    `schedule.budget_pages(t + 1)`; prompt positions (t < prompt_len) were prefilled densely, so they
    get a budget covering every page. Padding positions come after every real one and no real
    position attends to them, whatever their budget.
    """
    if schedule.page_size != 16:
        raise ValueError(f"the kernels select 16-token pages; schedule page_size is {schedule.page_size}")
    prompt_lens = torch.as_tensor(prompt_lens, dtype=torch.long)
    positions = torch.arange(seq_len, dtype=torch.long, device=prompt_lens.device)
    scheduled = schedule.budget_pages(positions + 1)
    every_page = torch.full_like(scheduled, -(-seq_len // 16))
    budgets = torch.where(positions[None, :] < prompt_lens[:, None], every_page[None, :], scheduled[None, :])
    return TeacherForcedPlan(
        budgets=budgets,
        sink=schedule.sink_blocks,
        local=schedule.local_blocks,
        dense_layers=frozenset(schedule.dense_layers),
        backend=backend,
    )


def recorded_plan(
    prompt_lens: Sequence[int],
    kv_budgets: Sequence[Sequence[int]],
    seq_len: int,
    sink: int = 1,
    local: int = 2,
    dense_layers: frozenset[int] = frozenset({0, 1}),
    backend: str = "auto",
) -> TeacherForcedPlan:
    """The plan that reproduces what a generator reported: `kv_budgets[i][t]` tokens for response token t.

    Response token t of row i was produced by the step whose query sat at position
    prompt_lens[i] + t - 1, so that position gets the budget (0 means dense, as for token 0, which
    the prefill produced, and as when a schedule's budget covered the whole context). Prompt
    positions and padding get every page.
    """
    rows = len(prompt_lens)
    if len(kv_budgets) != rows:
        raise ValueError(f"{rows} prompt lengths but {len(kv_budgets)} budget lists")
    every_page = -(-seq_len // 16)
    budgets = torch.full((rows, seq_len), every_page, dtype=torch.long)
    for i, (plen, row) in enumerate(zip(prompt_lens, kv_budgets, strict=True)):
        if plen - 1 + len(row) > seq_len:
            raise ValueError(f"row {i}: prompt {plen} + {len(row)} budgets do not fit in {seq_len} positions")
        b = torch.as_tensor(list(row), dtype=torch.long)
        if bool((b < 0).any()) or bool((b % 16 != 0).any()):
            raise ValueError(f"row {i}: budgets must be non-negative multiples of 16 tokens")
        pages = torch.where(b > 0, b // 16, torch.full_like(b, every_page))
        budgets[i, plen - 1 : plen - 1 + len(row)] = pages
    return TeacherForcedPlan(budgets=budgets, sink=sink, local=local, dense_layers=dense_layers, backend=backend)


def block_sparse_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sparrow_plan: TeacherForcedPlan | None = None,
    sparrow_cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: query [b, q_heads, t, d], key/value [b, kv_heads, T, d] -> [b, t, q_heads, d].

    Dispatches on `sparrow_cache` / `sparrow_plan` as the module docstring says.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if sparrow_cache is None and sparrow_plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("block-sparse attention does not combine with sliding-window layers")
    if sparrow_cache is not None:
        return sparrow_cache.attention(module, query, key, value, scaling), None
    layer = getattr(module, "layer_idx", None)
    if layer in sparrow_plan.dense_layers:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if layer is None:
        raise ValueError("block-sparse attention needs the attention module's layer_idx to tell dense layers apart")
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"teacher-forced block-sparse attention scores whole sequences without a KV cache; got {query.shape[2]} "
            f"queries over {key.shape[2]} keys (call the model with use_cache=False)"
        )
    if dropout:
        raise ValueError("block-sparse attention has no dropout; put the model in eval mode or set attention_dropout=0")
    b, _, t, _ = query.shape
    if tuple(sparrow_plan.budgets.shape) != (b, t):
        raise ValueError(f"plan budgets are {tuple(sparrow_plan.budgets.shape)} but this batch is {(b, t)}")
    from kernels import teacher_forced_attention

    out = teacher_forced_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        sparrow_plan.budgets.to(query.device),
        sink=sparrow_plan.sink,
        local=sparrow_plan.local,
        scale=scaling,
        backend=sparrow_plan.backend,
    )
    return out.contiguous(), None


def register() -> str:
    """Register the attention function and its (SDPA) mask builder with transformers; safe to call twice.

    Returns the name to pass as `attn_implementation`.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, block_sparse_attention_forward)
    # Without a mask builder of its own, transformers would hand a custom attention no mask at all;
    # the dense layers and the dense path need exactly the masks SDPA gets.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a loaded transformers model to the block-sparse attention function (in place); returns it."""
    name = register()
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ValueError(f"{type(model).__name__} does not accept a custom attention implementation")
    return model
