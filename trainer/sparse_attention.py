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

from sparrow.budget import PAGE_SIZE, num_pages, page_mismatch, replay_pages, whole_pages

if TYPE_CHECKING:
    from sparrow.schedule import Schedule

ATTN_IMPLEMENTATION = "sparrow_block_sparse"


@dataclass(frozen=True)
class BlockRule:
    """What the schedule fixes besides the budgets: sink and local blocks, and the layers that stay dense."""

    sink: int = 1
    local: int = 2
    dense_layers: frozenset[int] = frozenset({0, 1})

    @classmethod
    def of(cls, schedule: Schedule) -> BlockRule:
        """The rule of a schedule (budgets come from the rollouts themselves)."""
        return cls(schedule.sink_blocks, schedule.local_blocks, frozenset(schedule.dense_layers))


@dataclass(frozen=True)
class TeacherForcedPlan:
    """Budgets of one teacher-forced forward: `budgets` [batch, seq] in pages, position t under budgets[:, t]."""

    budgets: torch.Tensor
    sink: int = 1
    local: int = 2
    dense_layers: frozenset[int] = frozenset({0, 1})
    backend: str = "auto"
    # When a list: every sparse layer appends its selection loss (`selection_loss`) to it.
    selection: list | None = None


# Elements of one chunk's dense attention probabilities in `selection_loss` (about 128 MiB of float32).
SELECTION_CHUNK_ELEMENTS = 1 << 25


def selection_loss(
    query: torch.Tensor,
    key: torch.Tensor,
    budgets: torch.Tensor,
    sink: int,
    local: int,
    scaling: float | None = None,
    chunk_elements: int = SELECTION_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """How far the selection's page scores are from ranking the pages by the attention mass they hold; a scalar.

    query [b, q_heads, t, d] and key [b, kv_heads, t, d] as the layer computes them (positions
    encoded), budgets [b, t] in pages, as in a `TeacherForcedPlan`. For every position that selects
    (it holds more pages than its budget, and some page is neither sink nor local) and every KV head:
      - the target is the share of the layer's dense attention mass, averaged over the head's query
        group and detached, that each candidate page (neither sink nor local) holds;
      - the prediction is the softmax, over the same pages, of the scores the selection ranks them
        by: group-mean query . page centroid (the mean of the page's keys), at the attention's scale;
      - the term is KL(target || prediction), weighted by the mass the candidates hold together (where
        the sink and local pages hold nearly all of it, which pages win matters little).
    The loss is the mean over selecting positions and KV heads (0 when none selects). Its gradient
    reaches the queries and, through the centroids, the keys: the only way a loss can change which
    pages win the top-k, since the selection itself has no gradient. The dense probabilities are
    computed a chunk of positions at a time, `chunk_elements` at most.
    """
    b, hq, t, d = query.shape
    h = key.shape[1]
    g = hq // h
    scaling = 1.0 / d**0.5 if scaling is None else scaling
    pages = num_pages(t)
    pad = pages * PAGE_SIZE - t
    device = query.device
    pos = torch.arange(t, device=device)
    n = num_pages(pos + 1)  # pages holding positions 0..t
    page = torch.arange(pages, device=device)[None, :]
    cand = (page >= sink) & (page < (n - local)[:, None])  # [t, pages]: neither sink nor local
    selecting = (n[None, :] > budgets.to(device)) & cand.any(-1)[None, :]  # [b, t]
    count = int(selecting.sum())
    if count == 0:
        return query.new_zeros((), dtype=torch.float32)
    q, k = query.float(), key.float()
    cents = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(b, h, pages, PAGE_SIZE, d).mean(3)  # [b, h, P, d]
    qm = q.view(b, h, g, t, d).mean(2)  # [b, h, t, d]
    keys = k.detach().repeat_interleave(g, dim=1)  # [b, hq, t, d]
    step = max(1, chunk_elements // max(1, b * hq * t))
    total = query.new_zeros((), dtype=torch.float32)
    for lo in range(0, t, step):
        hi = min(t, lo + step)
        rows = selecting[:, lo:hi]
        if not bool(rows.any()):
            continue
        with torch.no_grad():
            logits = torch.einsum("bhcd,bhsd->bhcs", q[:, :, lo:hi].detach(), keys) * scaling
            logits = logits.masked_fill(pos[None, None, None, :] > pos[lo:hi, None], float("-inf"))
            mass = torch.nn.functional.pad(logits.softmax(-1), (0, pad)).view(b, hq, hi - lo, pages, PAGE_SIZE)
            mass = mass.sum(-1).view(b, h, g, hi - lo, pages).mean(2)  # [b, h, c, P]
            mask = cand[lo:hi][None, None] & rows[:, None, :, None]
            mass = mass * mask
            held = mass.sum(-1)  # [b, h, c]
            target = mass / held.clamp(min=1e-12)[..., None]
        scores = torch.einsum("bhcd,bhpd->bhcp", qm[:, :, lo:hi], cents) * scaling
        # A finite fill: rows with no candidate (not selecting) stay finite, and so do their gradients.
        logp = scores.masked_fill(~mask, torch.finfo(scores.dtype).min).log_softmax(-1).masked_fill(~mask, 0.0)
        kl = (target * (target.clamp(min=1e-12).log() - logp)).sum(-1)  # [b, h, c]
        total = total + (kl * held * rows[:, None, :]).sum()
    return total / (count * h)


def teacher_forced_plan(
    schedule: Schedule, prompt_lens: torch.Tensor, seq_len: int, backend: str = "auto"
) -> TeacherForcedPlan:
    """The plan that reproduces decoding under `schedule` for right-padded sequences of `seq_len` positions.

    Position t of a row has KV length t + 1 when it is decoded, so its budget is
    `schedule.budget_pages(t + 1)`; prompt positions (t < prompt_len) were prefilled densely, so they
    get a budget covering every page. Padding positions come after every real one and no real
    position attends to them, whatever their budget.
    """
    if mismatch := page_mismatch(schedule.page_size):
        raise ValueError(mismatch)
    prompt_lens = torch.as_tensor(prompt_lens, dtype=torch.long)
    positions = torch.arange(seq_len, dtype=torch.long, device=prompt_lens.device)
    scheduled = schedule.budget_pages(positions + 1)
    every_page = torch.full_like(scheduled, num_pages(seq_len))
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
    every_page = num_pages(seq_len)
    budgets = torch.full((rows, seq_len), every_page, dtype=torch.long)
    for i, (plen, row) in enumerate(zip(prompt_lens, kv_budgets, strict=True)):
        if plen - 1 + len(row) > seq_len:
            raise ValueError(f"row {i}: prompt {plen} + {len(row)} budgets do not fit in {seq_len} positions")
        b = torch.as_tensor(list(row), dtype=torch.long)
        if bool((b < 0).any()) or not bool(whole_pages(b).all()):
            raise ValueError(f"row {i}: budgets must be non-negative multiples of {PAGE_SIZE} tokens")
        budgets[i, plen - 1 : plen - 1 + len(row)] = replay_pages(b, every_page)
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

    if sparrow_plan.selection is not None and torch.is_grad_enabled():
        sparrow_plan.selection.append(
            selection_loss(query, key, sparrow_plan.budgets, sparrow_plan.sink, sparrow_plan.local, scaling)
        )
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
