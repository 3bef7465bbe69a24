"""Exact alpha of every rollout token: the sparse actor's full distribution against the dense policy's, in float64.

alpha = sum_v min(p(v), q(v)) over the whole vocabulary, with q the sparse actor (teacher-forced
block-sparse attention under the budgets each token was decoded with, `trainer.sparse_attention
.recorded_plan`; with the DistillSparse adapter on when one served the token) and p the dense policy,
both at the sampling temperature and both from the trainer's one model in one process. So the value
measures what sparsity costs, not engine-vs-trainer numerics (which TIS handles), and it is exact
where the generators' top-20 lists give only a lower bound.

It rides on the dense scoring the step does anyway (`trainer.scoring.Scorer.score`): before each of
its micro-batches, `ExactAlpha.pair` runs the sparse forward of the same rows (no gradient) and keeps
its last hidden states [tokens, hidden]; the scorer's LM head hands each chunk of dense log-probs to
the pairing callback, which takes the sparse side's chunk from `trainer.lm_head.log_distributions`
(the same chunking, in step) and reduces both to alpha. At most one [chunk, vocab] float32 tensor per
side exists at a time, and the float64 reduction runs over half a chunk at a time, so its
temporaries are no larger: never a [tokens, vocab] tensor for the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparrow.acceptance import alpha_exact
from trainer import lm_head, sparse_attention
from trainer.batch import Rollout, collate

if TYPE_CHECKING:
    from trainer.distill import BlockRule

log = logging.getLogger("sparrow.trainer.exact_alpha")


def reproducible(rollout: Rollout) -> bool:
    """Whether the teacher-forced forward can reproduce the budgets the rollout's tokens were decoded with."""
    return len(rollout.kv_budgets) in (0, len(rollout.token_ids)) and all(b % 16 == 0 for b in rollout.kv_budgets)


class ChunkPair:
    """The scorer's `on_chunk` callback for one micro-batch: alpha of each dense chunk against its sparse twin."""

    def __init__(
        self, sparse_hidden: torch.Tensor, weight: torch.Tensor, temperature: float, chunk: int, dtype: torch.dtype
    ) -> None:
        self._sparse = lm_head.log_distributions(sparse_hidden, weight, temperature, chunk, dtype)
        self._rows = sparse_hidden.shape[0]
        self._parts: list[torch.Tensor] = []

    def __call__(self, start: int, dense_logp: torch.Tensor) -> None:
        at, sparse_logq = next(self._sparse)
        if at != start or sparse_logq.shape != dense_logp.shape:
            raise ValueError(f"sparse chunk at {at} {tuple(sparse_logq.shape)} does not pair with dense chunk at "
                             f"{start} {tuple(dense_logp.shape)}")  # fmt: skip
        # The float64 log-softmax of alpha_exact makes [rows, vocab] float64 temporaries: half a chunk of rows
        # at a time keeps each one the size of the chunk's float32 logits.
        step = max(1, dense_logp.shape[0] // 2)
        for s in range(0, dense_logp.shape[0], step):
            self._parts.append(alpha_exact(sparse_logq[s : s + step], dense_logp[s : s + step]).cpu())
        del sparse_logq

    def alpha(self) -> torch.Tensor:
        """Alpha [tokens] float64 of every row, once the scorer has passed every chunk."""
        out = torch.cat(self._parts) if self._parts else torch.zeros(0, dtype=torch.float64)
        if out.numel() != self._rows:
            raise RuntimeError(f"the scorer passed {out.numel()} of {self._rows} positions to the exact-alpha pass")
        return out


@dataclass
class ExactAlpha:
    """The sparse actor's side of the exact-alpha pass: the models, the block rule and how the forward runs.

    `policy` is the dense policy (switched to `trainer.sparse_attention`), `adapter_model` the
    DistillSparse actor whose adapter is on (None without DistillSparse): a rollout whose
    `adapter_version` is > 0 was served with an adapter and is scored through it (the adapter as
    the trainer holds it now, as the policy is the trainer's current one). `rule_source` gives the
    block rule of the schedule in force (sink, local, dense layers; the budgets come from each
    rollout), read once per step.
    """

    policy: torch.nn.Module
    rule_source: Callable[[], BlockRule]
    temperature: float = 1.0
    chunk: int = lm_head.DEFAULT_CHUNK
    dtype: torch.dtype | None = None
    backend: str = "auto"
    adapter_model: torch.nn.Module | None = None

    def __post_init__(self) -> None:
        self.policy = sparse_attention.install(self.policy)
        self._rule: BlockRule | None = None

    def begin_step(self) -> None:
        """Read the block rule for this step's forwards."""
        self._rule = self.rule_source()

    @torch.no_grad()
    def pair(self, rollouts: Sequence[Rollout]) -> ChunkPair:
        """Run the sparse forward of `rollouts` (one micro-batch, in order) and return the pairing callback.

        A rollout whose budgets cannot be reproduced runs dense here, so its rows keep their place in the
        chunking; the caller reports its tokens as having no exact alpha (`unreproducible_mask`).
        """
        from trainer.rl_update import response_hidden

        if self._rule is None:
            self.begin_step()
        rule = self._rule
        fixed = [r if reproducible(r) else _without_budgets(r) for r in rollouts]
        mb = collate(fixed, torch.zeros(len(fixed)), list(range(len(fixed))))
        device = next(self.policy.parameters()).device
        mb = mb.to(device)
        plan = sparse_attention.recorded_plan(
            mb.prompt_lens, [r.kv_budgets for r in fixed], mb.input_ids.shape[1], rule.sink, rule.local,
            rule.dense_layers, self.backend,
        )  # fmt: skip
        served = torch.tensor([r.adapter_version > 0 for r in fixed], dtype=torch.bool)
        if self.adapter_model is None or not bool(served.any()):
            hidden = response_hidden(self.policy, mb, self.dtype, sparrow_plan=plan)
        else:
            hidden = self._mixed(mb, fixed, plan, served)
        return ChunkPair(hidden, lm_head.output_weight(self.policy), self.temperature, self.chunk,
                         self.dtype or hidden.dtype)  # fmt: skip

    def _mixed(self, mb, rollouts: Sequence[Rollout], plan, served: torch.Tensor) -> torch.Tensor:
        """Response hidden states of a micro-batch whose rows were served with and without the adapter, in order."""
        from trainer.rl_update import response_hidden

        both = {}
        for on, model in ((True, self.adapter_model), (False, self.policy)):
            rows = [i for i in range(len(rollouts)) if bool(served[i]) == on]
            if not rows:
                continue
            sub = collate([rollouts[i] for i in rows], torch.zeros(len(rows)), list(range(len(rows))))
            sub = sub.to(mb.input_ids.device)
            width = sub.input_ids.shape[1]
            sub_plan = sparse_attention.TeacherForcedPlan(
                budgets=plan.budgets[rows, :width], sink=plan.sink, local=plan.local,
                dense_layers=plan.dense_layers, backend=plan.backend,
            )  # fmt: skip
            hidden = response_hidden(model, sub, self.dtype, sparrow_plan=sub_plan)
            for i, part in zip(rows, torch.split(hidden, [len(rollouts[i].token_ids) for i in rows]), strict=True):
                both[i] = part
        return torch.cat([both[i] for i in range(len(rollouts))])


def unreproducible_mask(rollouts: Sequence[Rollout]) -> torch.Tensor:
    """[tokens] bool: the tokens of rollouts whose budgets the teacher-forced forward cannot reproduce."""
    parts = [torch.full((len(r.token_ids),), not reproducible(r), dtype=torch.bool) for r in rollouts]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def _without_budgets(r: Rollout) -> Rollout:
    import dataclasses

    return dataclasses.replace(r, kv_budgets=())
