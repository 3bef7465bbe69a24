"""Exact alpha of every rollout token: the sparse actor's full distribution against the dense policy's, in float64.

alpha = sum_v min(p(v), q(v)) over the whole vocabulary, with q the sparse actor (teacher-forced
block-sparse attention under the budgets each token was decoded with, `trainer.sparse_attention
.recorded_plan`; with the DistillSparse adapter on when one served the token) and p the dense policy,
both at the sampling temperature and both from the trainer's one model (on several ranks each scores
its share of the batch, `trainer.rl_update.learn`, and the values are gathered). So the value
measures what sparsity costs, not engine-vs-trainer numerics (which TIS handles), and it is exact
where the generators' top-20 lists give only a lower bound.

It rides on the dense scoring the step does anyway (`trainer.scoring.Scorer.score`): before each of
its micro-batches, `ExactAlpha.pair` runs the sparse forward of the same rows (no gradient) and keeps
its last hidden states [tokens, hidden]; the scorer's LM head hands each chunk of dense log-probs to
the pairing callback, which computes the sparse side's logits for the same rows and reduces both to
alpha (`chunk_alpha`). At most two [chunk, vocab] float32 tensors of its own exist at a time (the
sparse logits, then their exponentials in place, and the dense probabilities): never a
[tokens, vocab] tensor for the batch.

Where the time goes (profiled on `bench.exact_alpha`, Qwen3's vocabulary): the vocabulary-sized work,
not the sparse forward. So the reduction runs in float32 elementwise passes over buffers it reuses,
with only the per-token sums in float64 (`chunk_alpha`, within 1e-7 of the float64 log-softmax
route), and a row whose whole context was attended densely in every layer (the prompt's, or every
position's budget covering its pages so far; no adapter) gets alpha 1 without a second LM head: its
sparse forward is the dense one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparrow.budget import num_pages, reproducible
from trainer import lm_head, sparse_attention
from trainer.batch import Rollout, collate
from trainer.scoring import response_hidden

if TYPE_CHECKING:
    from trainer.lora import LoraAdapter
    from trainer.sparse_attention import BlockRule

log = logging.getLogger("sparrow.trainer.exact_alpha")


# Row sums in float32 over blocks of this many entries, the blocks' partial sums added in float64.
_SUM_BLOCK = 4096


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """[rows] float64 sums of x [rows, vocab] float32: float32 within blocks of `_SUM_BLOCK`, float64 across them.

    A float64 `sum(dtype=...)` converts the whole tensor first (as slow as the elementwise passes
    themselves); a block of 4096 non-negative float32 terms sums to within ~1e-7 of its total.
    """
    rows, n = x.shape
    whole = n - n % _SUM_BLOCK
    out = x[:, :whole].view(rows, -1, _SUM_BLOCK).sum(-1).double().sum(-1)
    if whole < n:
        out += x[:, whole:].sum(-1).double()
    return out


def chunk_alpha(
    sparse_logits: torch.Tensor, dense_logp: torch.Tensor, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact alpha [rows] float64 = sum_v min(p(v), q(v)) of one chunk, with no [rows, vocab] float64 tensor.

    `sparse_logits` [rows, vocab] float32 are the sparse side's logits at the temperature; they are
    consumed (overwritten with exp(logit - max)). `dense_logp` [rows, vocab] float32 are the dense
    side's log-probs (read only; renormalised here, as `sparrow.acceptance.alpha_exact` does).
    `scratch`, of the same shape, takes the dense probabilities (allocated when None). Both sides are
    normalised by their float64 sums, so the float32 normaliser error of a 151,936-entry softmax
    (~1e-6) does not reach alpha; what remains is one rounding per entry, within 1e-7 of
    `alpha_exact` in float64.
    """
    if sparse_logits.shape != dense_logp.shape or sparse_logits.dim() != 2:
        raise ValueError(f"expected two [rows, vocab] tensors of one shape, got {tuple(sparse_logits.shape)} "
                         f"and {tuple(dense_logp.shape)}")  # fmt: skip
    e = sparse_logits.sub_(sparse_logits.amax(-1, keepdim=True)).exp_()  # q * sum_q
    sum_q = _row_sums(e)
    p = torch.exp(dense_logp, out=scratch) if scratch is not None else dense_logp.exp()
    sum_p = _row_sums(p)
    # min(p / sum_p, e / sum_q) = min(p * sum_q / sum_p, e) / sum_q: one scaling pass, the division per row.
    p.mul_((sum_q / sum_p).to(p.dtype)[:, None])
    torch.minimum(p, e, out=p)
    return (_row_sums(p) / sum_q).clamp_(0.0, 1.0)


class ChunkPair:
    """The scorer's `on_chunk` callback for one micro-batch: alpha of each dense chunk against its sparse twin.

    `differs` [rows] bool marks the rows whose sparse distribution can differ from the dense one;
    the others get alpha 1 (their sparse forward is the dense one) without a sparse LM head.
    """

    def __init__(
        self,
        sparse_hidden: torch.Tensor,
        weight: torch.Tensor,
        temperature: float,
        chunk: int,
        dtype: torch.dtype,
        differs: torch.Tensor | None = None,
    ) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self._hidden = sparse_hidden.detach()
        self._rows = sparse_hidden.shape[0]
        self._w = weight.detach().to(dtype)
        self._temperature = temperature
        self._differs = (
            torch.ones(self._rows, dtype=torch.bool) if differs is None else differs.to(device="cpu", dtype=torch.bool)
        )
        if self._differs.shape != (self._rows,):
            raise ValueError(f"differs has shape {tuple(self._differs.shape)}, expected ({self._rows},)")
        self._next = 0
        self._scratch: torch.Tensor | None = None
        self._parts: list[torch.Tensor] = []

    def __call__(self, start: int, dense_logp: torch.Tensor) -> None:
        n = dense_logp.shape[0]
        if start != self._next or start + n > self._rows or dense_logp.shape[1] != self._w.shape[0]:
            raise ValueError(f"dense chunk at {start} {tuple(dense_logp.shape)} does not pair with the sparse rows "
                             f"(next at {self._next} of {self._rows}, vocabulary {self._w.shape[0]})")  # fmt: skip
        self._next = start + n
        out = torch.ones(n, dtype=torch.float64)
        differs = self._differs[start : start + n]
        if bool(differs.all()):
            out = self._alpha(self._hidden[start : start + n], dense_logp).cpu()
        elif bool(differs.any()):
            idx = differs.nonzero()[:, 0]
            on = idx.to(dense_logp.device)
            out[idx] = self._alpha(self._hidden[start : start + n][on], dense_logp[on]).cpu()
        self._parts.append(out)

    def _alpha(self, hidden: torch.Tensor, dense_logp: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = lm_head.scaled_logits(hidden, self._w, self._temperature)
            if self._scratch is None or self._scratch.shape[0] < logits.shape[0]:
                self._scratch = torch.empty_like(logits)
            return chunk_alpha(logits, dense_logp, self._scratch[: logits.shape[0]])

    def alpha(self) -> torch.Tensor:
        """Alpha [tokens] float64 of every row, once the scorer has passed every chunk."""
        self._scratch = None
        out = torch.cat(self._parts) if self._parts else torch.zeros(0, dtype=torch.float64)
        if out.numel() != self._rows:
            raise RuntimeError(f"the scorer passed {out.numel()} of {self._rows} positions to the exact-alpha pass")
        return out


@dataclass
class ExactAlpha:
    """The sparse actor's side of the exact-alpha pass: the model, the block rule and how the forward runs.

    `policy` is the dense policy (switched to `trainer.sparse_attention`), `adapter` the DistillSparse
    adapter hooked into it (`trainer.lora.LoraAdapter`; None without DistillSparse): a rollout whose
    `adapter_version` is > 0 was served with an adapter and is scored with it on (the adapter as the
    trainer holds it now, as the policy is the trainer's current one), in the same forward as the
    rows served without one (the adapter on for those rows only). `rule_source` gives the block rule
    of the schedule in force (sink, local, dense layers; the budgets come from each rollout), read
    once per step; on several ranks each rank's source gives the one rank 0 read for the step.
    """

    policy: torch.nn.Module
    rule_source: Callable[[], BlockRule]
    temperature: float = 1.0
    chunk: int = lm_head.DEFAULT_CHUNK
    dtype: torch.dtype | None = None
    backend: str = "auto"
    adapter: LoraAdapter | None = None

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
        import contextlib

        from trainer.distributed import compute_device

        if self._rule is None:
            self.begin_step()
        rule = self._rule
        fixed = [r if reproducible(r.kv_budgets, len(r.token_ids)) else _without_budgets(r) for r in rollouts]
        mb = collate(fixed, torch.zeros(len(fixed)), list(range(len(fixed))))
        mb = mb.to(compute_device(self.policy))
        plan = sparse_attention.recorded_plan(
            mb.prompt_lens, [r.kv_budgets for r in fixed], mb.input_ids.shape[1], rule.sink, rule.local,
            rule.dense_layers, self.backend,
        )  # fmt: skip
        served = torch.tensor([r.adapter_version > 0 for r in fixed], dtype=torch.bool)
        if self.adapter is None:
            served = torch.zeros_like(served)
        # One forward whatever the rows were served with (under FSDP2 it is a collective every rank joins,
        # once per micro-batch); the adapter's hooks add nothing collective, so each rank switches it alone.
        with self.adapter.on(rows=served) if bool(served.any()) else contextlib.nullcontext():
            hidden = response_hidden(self.policy, mb, self.dtype, sparrow_plan=plan)
        differs = sparse_rows(plan.budgets, mb.mask.cpu().bool(), served)
        return ChunkPair(hidden, lm_head.output_weight(self.policy), self.temperature, self.chunk,
                         self.dtype or hidden.dtype, differs)  # fmt: skip


def sparse_rows(budgets: torch.Tensor, mask: torch.Tensor, served: torch.Tensor) -> torch.Tensor:
    """[tokens] bool, the response rows (under `mask` [b, T - 1]) whose sparse forward can differ from the dense one.

    `budgets` [b, T] in pages are a plan's; position s holds num_pages(s + 1) pages, so a budget of at
    least that many attends to all of them (densely). The hidden state at position t is the dense
    one when every position up to t did, in every layer; a row of a rollout `served` [b] with the
    adapter always differs (its sparse side is another model).
    """
    held = num_pages(torch.arange(1, budgets.shape[1] + 1, dtype=torch.long))
    selecting = (budgets.cpu() < held[None, :]).long().cummax(dim=1).values.bool()  # any position <= t selected
    differs = selecting[:, :-1] | served[:, None]
    return differs[mask]


def unreproducible_mask(rollouts: Sequence[Rollout]) -> torch.Tensor:
    """[tokens] bool: the tokens of rollouts whose budgets the teacher-forced forward cannot reproduce."""
    parts = [
        torch.full((len(r.token_ids),), not reproducible(r.kv_budgets, len(r.token_ids)), dtype=torch.bool)
        for r in rollouts
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def _without_budgets(r: Rollout) -> Rollout:
    import dataclasses

    return dataclasses.replace(r, kv_budgets=())
