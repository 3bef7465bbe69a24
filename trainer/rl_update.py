"""One RL step's learning: dense teacher-forced scores of the rollouts, alpha against the generators' top-k,
and the GRPO + TIS update of the dense policy.

Written to run unchanged under torch.distributed with FSDP2: the model is called directly (no
`.module`), the loss is normalised by the global token count (`trainer.grpo.global_token_count`),
gradients are clipped with `clip_grad_norm_` (DTensor-aware) and nothing here reads or writes state
dicts. Each rank passes its own rollouts; under FSDP every rank must run the same number of
micro-batches, since each forward and backward is a collective.

The LM head runs on the response positions only, `lm_head_chunk` of them at a time
(`trainer.lm_head`), in the forward and the backward: no [tokens, vocab] logits. Micro-batches are
`micro_batch_size` rows, or, with `max_tokens_per_microbatch`, rows of similar length packed up to
that many padded tokens (`trainer.batch.plan_micro_batches`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparrow.acceptance import alpha_topk
from trainer import distributed, lm_head
from trainer.batch import PAD_ROLLOUT, MicroBatch, Rollout, generator_topk, micro_batches, pad_batch, plan_micro_batches
from trainer.grpo import GRPOConfig, global_token_count, grpo_tis_loss
from trainer.scoring import Scorer, TokenScores, masked_logprobs

if TYPE_CHECKING:
    from sparrow.timing import PhaseTimer
    from trainer.exact_alpha import ExactAlpha


@dataclass(frozen=True)
class UpdateConfig:
    """How the update runs: the loss's knobs, temperature, micro-batches, LM-head chunk, dtype, clipping."""

    grpo: GRPOConfig = GRPOConfig()
    temperature: float = 1.0
    micro_batch_size: int = 8  # rows per micro-batch at most
    max_grad_norm: float = 1.0  # 0 disables clipping
    max_tokens_per_microbatch: int = 0  # padded tokens per micro-batch at most (0: rows only)
    lm_head_chunk: int = lm_head.DEFAULT_CHUNK  # positions per LM-head chunk
    dtype: torch.dtype | None = None  # compute dtype (None or float32: full precision)


@dataclass
class Acceptance:
    """Alpha of every response token of the batch, with the KV length it was produced at.

    `alpha` is the top-k lower bound (generators' lists against the dense policy's); `exact`, when the
    step ran the exact pass (`trainer.exact_alpha`), the exact value over the vocabulary, NaN for the
    tokens of a rollout whose budgets the teacher-forced forward cannot reproduce.
    """

    alpha: torch.Tensor  # [tokens] float32
    kv_lens: torch.Tensor  # [tokens] int64
    exact: torch.Tensor | None = None  # [tokens] float64
    exact_seconds: float = 0.0  # wall time of this rank's exact pass (`PassTime`), 0 without one


@dataclass
class PassTime:
    """Wall seconds the exact-alpha pass took: its sparse forwards, its side of each LM-head chunk (the sparse
    logits and the float64 reduction, run inside the dense scoring) and collecting the values. With `phases`
    the same calls are charged to its `exact_alpha` phase (out of the dense scoring they run inside)."""

    seconds: float = 0.0
    phases: PhaseTimer | None = None

    def timed(self, call: Callable) -> Callable:
        """`call`, adding the time each call takes."""
        call = self.phases.timed("exact_alpha", call) if self.phases is not None else call

        def run(*args):
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return run


def dense_scores(
    scorer: Scorer,
    rollouts: Sequence[Rollout],
    temperature: float,
    micro_batch_size: int,
    max_tokens: int = 0,
) -> list[TokenScores]:
    """Dense teacher-forced logprobs and top-k lists of every rollout's response (in the rollouts' order)."""
    return scores_and_exact(scorer, rollouts, temperature, micro_batch_size, max_tokens)[0]


def scores_and_exact(
    scorer: Scorer,
    rollouts: Sequence[Rollout],
    temperature: float,
    micro_batch_size: int,
    max_tokens: int = 0,
    exact: ExactAlpha | None = None,
    timing: PassTime | None = None,
) -> tuple[list[TokenScores], list[torch.Tensor] | None]:
    """`dense_scores`, and with `exact` each rollout's exact alpha [response_len] float64 (else None).

    The sparse forward of each micro-batch runs just before its dense scoring, whose LM-head chunks
    it pairs with (`trainer.exact_alpha`). `timing` adds up the exact pass's own time.
    """
    from trainer.exact_alpha import unreproducible_mask

    out: list[TokenScores | None] = [None] * len(rollouts)
    exact_out: list[torch.Tensor | None] = [None] * len(rollouts)
    lengths = [r.prompt_len + len(r.token_ids) for r in rollouts]
    plan = plan_micro_batches(lengths, micro_batch_size, max_tokens)
    # Under FSDP every forward is a collective: ranks agree on the busiest one's count before any
    # forward, and the others pad with 2-token passes.
    passes = distributed.max_over_ranks(len(plan))
    timing = timing if timing is not None else PassTime()
    for rows in plan:
        picked = [rollouts[r] for r in rows]
        pair = timing.timed(exact.pair)(picked) if exact is not None else None
        on_chunk = timing.timed(pair) if pair is not None else None
        scores = scorer.score(
            [r.sequence for r in picked], [r.prompt_len for r in picked], None, temperature, on_chunk=on_chunk
        )
        for row, score in zip(rows, scores, strict=True):
            out[row] = score
        if pair is not None:
            alpha = timing.timed(pair.alpha)().masked_fill(unreproducible_mask(picked), float("nan"))
            for row, part in zip(rows, torch.split(alpha, [len(r.token_ids) for r in picked]), strict=True):
                exact_out[row] = part
    for _ in range(passes - len(plan)):
        pad = PAD_ROLLOUT
        pair = timing.timed(exact.pair)([pad]) if exact is not None else None
        scorer.score(
            [pad.sequence],
            [pad.prompt_len],
            None,
            temperature,
            on_chunk=timing.timed(pair) if pair is not None else None,
        )
    return out, (exact_out if exact is not None else None)  # type: ignore[return-value]


def acceptance(rollouts: Sequence[Rollout], dense: Sequence[TokenScores]) -> Acceptance:
    """Per-token alpha (lower bound from top-k lists) of the generators' distributions against the dense ones."""
    if len(rollouts) != len(dense):
        raise ValueError(f"{len(rollouts)} rollouts but {len(dense)} dense scores")
    if not rollouts:  # a rank whose share of a small batch is empty
        return Acceptance(alpha=torch.zeros(0), kv_lens=torch.zeros(0, dtype=torch.long))
    gen_ids, gen_lps = generator_topk(rollouts)
    dense_ids = torch.cat([d.top_ids.cpu() for d in dense])
    dense_lps = torch.cat([d.top_logprobs.cpu() for d in dense])
    alpha = alpha_topk(gen_ids, gen_lps, dense_ids, dense_lps)
    return Acceptance(alpha=alpha, kv_lens=torch.cat([r.kv_lens() for r in rollouts]))


def grpo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollouts: Sequence[Rollout],
    old_logprobs: Sequence[torch.Tensor],
    advantages: torch.Tensor,
    config: UpdateConfig,
) -> dict[str, float]:
    """One optimizer step of GRPO + TIS over the batch; returns token-weighted statistics of the loss.

    `old_logprobs[i]` are the dense old policy's logprobs of rollout i's response tokens (the
    denominator of the PPO ratio and the numerator of the TIS weight).
    """
    if len(old_logprobs) != len(rollouts):
        raise ValueError(f"{len(rollouts)} rollouts but {len(old_logprobs)} old logprob rows")
    device = distributed.compute_device(model)  # the GPU also when the shards are offloaded
    batches = micro_batches(rollouts, advantages, config.micro_batch_size, config.max_tokens_per_microbatch)
    local_tokens = sum(len(r.token_ids) for r in rollouts)
    num_tokens = global_token_count(torch.tensor([float(local_tokens)], device=device))
    # Under FSDP every forward and backward is a collective: ranks agree on the busiest one's count
    # first, and the others pad with passes whose loss is 0.
    passes = distributed.max_over_ranks(len(batches))
    scale = distributed.gradient_scale()
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    loss_sum = 0.0
    for mb in batches:
        mb = mb.to(device)
        old = mb.place([old_logprobs[r] for r in mb.rows])
        loss, stats = _micro_loss(model, mb, old, config, num_tokens)
        (loss * scale).backward() if scale != 1.0 else loss.backward()
        loss_sum += float(loss.detach())
        weight = stats["tokens"]
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + (value if key == "tokens" else value * weight)
    for _ in range(passes - len(batches)):
        (
            masked_logprobs(model, pad_batch(device), config.temperature, config.lm_head_chunk, config.dtype).sum()
            * 0.0
        ).backward()
    grad_norm = _clip(model, config.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    keys = sorted(totals)
    totals = dict(zip(keys, distributed.sum_over_ranks([totals[k] for k in keys]), strict=True))
    tokens = max(totals.get("tokens", 0.0), 1.0)
    out = {key: (value if key == "tokens" else value / tokens) for key, value in totals.items()}
    out["loss"] = distributed.sum_over_ranks([loss_sum])[0]
    out["grad_norm"] = grad_norm
    return out


def _micro_loss(
    model: torch.nn.Module, mb: MicroBatch, old: torch.Tensor, config: UpdateConfig, num_tokens: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    logprobs = masked_logprobs(model, mb, config.temperature, config.lm_head_chunk, config.dtype)
    return grpo_tis_loss(logprobs, old, mb.rollout_logprobs, mb.advantages, mb.mask, config.grpo, num_tokens)


def learn(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scorer: Scorer,
    rollouts: Sequence[Rollout],
    advantages: torch.Tensor,
    config: UpdateConfig,
    exact: ExactAlpha | None = None,
    phases: PhaseTimer | None = None,
) -> tuple[list[TokenScores], Acceptance, dict[str, float]]:
    """One step's learning on the whole batch, on one rank or many: dense scores, alpha and the update.

    With `exact` the acceptance also holds the exact alpha (`trainer.exact_alpha`), from the policy
    before this step's update, as the dense scores are.

    Every rank passes the same batch (rank 0's, broadcast) and takes its share of it
    (`trainer.distributed.share`); the loss is normalised by the global token count, so the update
    does not depend on the number of ranks. Returns this rank's dense scores (of its share, in
    order), the acceptance of the WHOLE batch in the batch's order (gathered from every rank), and
    the update's statistics over the whole batch.

    With `phases` (sparrow.timing) the dense scoring and alpha go to its `score` phase, the exact pass to
    `exact_alpha`, the update to `update`.
    """
    mine = distributed.share(rollouts)
    local = [rollouts[i] for i in mine]
    timing = PassTime(phases=phases)
    with phases.phase("score") if phases is not None else nullcontext():
        dense, placed = _score(scorer, local, mine, config, exact, timing)
    order = range(len(rollouts))
    whole = Acceptance(
        alpha=torch.cat([placed[i][0] for i in order]) if rollouts else torch.zeros(0),
        kv_lens=torch.cat([r.kv_lens() for r in rollouts]) if rollouts else torch.zeros(0, dtype=torch.long),
        exact=(
            (torch.cat([placed[i][1] for i in order]) if rollouts else torch.zeros(0, dtype=torch.float64))
            if exact is not None
            else None
        ),
        exact_seconds=timing.seconds,
    )
    with phases.phase("update") if phases is not None else nullcontext():
        stats = grpo_update(model, optimizer, local, [d.logprobs for d in dense], advantages[mine], config)
    return dense, whole, stats


def _score(
    scorer: Scorer,
    local: Sequence[Rollout],
    mine: Sequence[int],
    config: UpdateConfig,
    exact: ExactAlpha | None,
    timing: PassTime,
) -> tuple[list[TokenScores], dict[int, tuple[torch.Tensor, torch.Tensor | None]]]:
    """`learn`'s dense scores of this rank's share, and every rank's alpha by batch index (bound, exact or None)."""
    if exact is not None:
        timing.timed(exact.begin_step)()
    dense, exact_rows = scores_and_exact(
        scorer, local, config.temperature, config.micro_batch_size, config.max_tokens_per_microbatch, exact, timing
    )
    acc = acceptance(local, dense)
    bounds = torch.split(acc.alpha, [len(r.token_ids) for r in local])
    per_rollout = [(i, (b, exact_rows[j] if exact_rows is not None else None)) for j, (i, b) in
                   enumerate(zip(mine, bounds, strict=True))]  # fmt: skip
    placed: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for part in distributed.gather_objects(per_rollout):
        placed.update(part)
    return dense, placed


def _clip(model: torch.nn.Module, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    # An infinite bound measures the norm without scaling anything.
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    # Under FSDP2 the norm is a DTensor; its full value is the same on every rank.
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)
