"""The per-token KV budget: one rule, in tokens, for every decode path and every replay of one.

A decode step at KV length `n` (its own new key included) keeps the budget its schedule (or probe
plan) gives n's bin: that many cached tokens, sink and local pages included. A budget of at least
`n` keeps every page, so the step attends densely, and it is reported as 0, like the dense prefill
that produces a response's first token. These reported budgets are what generators send with each
token (`kv_budgets`) and what the trainer's teacher-forced forward replays.

Budgets are counted in tokens everywhere; the kernels take pages of `PAGE_SIZE` tokens, and `in_pages`
is the one conversion, at that boundary. A reported budget the kernels cannot replay (not a whole
number of pages) makes a rollout not `reproducible`.

Plain Python (torch only through the tensors it is given), so that schedules stay quick to read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kernels.pages import PAGE_SIZE, num_pages

if TYPE_CHECKING:
    import torch

__all__ = [
    "PAGE_SIZE",
    "BudgetSource",
    "kept_budget",
    "num_pages",
    "page_mismatch",
    "in_pages",
    "replay_pages",
    "reproducible",
    "step_budget",
    "whole_pages",
]


class BudgetSource(Protocol):
    """What gives a budget in tokens per KV length: a `Schedule` or a `ProbePlan`."""

    def budget_for(self, kv_len: int) -> int: ...

    def budget_tokens(self, kv_lens: torch.Tensor) -> torch.Tensor: ...


def kept_budget(budget: int | torch.Tensor, kv_len: int | torch.Tensor) -> int | torch.Tensor:
    """The budget the decode step at KV length `kv_len` reports when `budget` tokens are scheduled for it.

    `budget` where it keeps fewer tokens than are cached; 0 where it keeps them all (dense attention).
    """
    return budget * (budget < kv_len)


def step_budget(source: BudgetSource | None, kv_len: int | torch.Tensor) -> int | torch.Tensor:
    """KV budget in tokens of the decode step at KV length `kv_len` under `source`, as `kept_budget` reports it.

    `source` None (no schedule) decodes densely: 0. `kv_len` an int or an integer tensor (then one
    budget per length, int64).
    """
    if source is None:
        return kv_len * 0
    scheduled = source.budget_for(kv_len) if isinstance(kv_len, int) else source.budget_tokens(kv_len)
    return kept_budget(scheduled, kv_len)


def in_pages(budget: int | torch.Tensor, page_size: int = PAGE_SIZE) -> int | torch.Tensor:
    """A budget in tokens (a whole number of pages) as the number of pages the kernels keep."""
    return budget // page_size


def whole_pages(budget: int | torch.Tensor, page_size: int = PAGE_SIZE) -> bool | torch.Tensor:
    """Whether `budget` tokens are a whole number of pages (elementwise for a tensor)."""
    return budget % page_size == 0


def replay_pages(budget: torch.Tensor, every: int | torch.Tensor) -> torch.Tensor:
    """The pages a teacher-forced position keeps for a reported `budget` in tokens: `in_pages(budget)`, or `every`
    (a count covering all of its pages) where the step attended densely (0)."""
    import torch

    return torch.where(budget > 0, in_pages(budget), torch.as_tensor(every, dtype=budget.dtype, device=budget.device))


def reproducible(kv_budgets: Sequence[int], num_tokens: int) -> bool:
    """Whether the teacher-forced forward can replay the budgets a response of `num_tokens` tokens reported.

    They can be absent (dense) or one per token, each a whole number of pages.
    """
    return len(kv_budgets) in (0, num_tokens) and all(whole_pages(b) for b in kv_budgets)


def page_mismatch(page_size: int) -> str | None:
    """Why a schedule of `page_size`-token pages cannot run on the kernels, in one line; None when it can."""
    if page_size == PAGE_SIZE:
        return None
    return f"the kernels select {PAGE_SIZE}-token pages; schedule page_size is {page_size}"
