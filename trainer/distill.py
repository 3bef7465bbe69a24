"""DistillSparse: a LoRA adapter on the sparse actor that keeps it close to the dense policy (DESIGN.md section 1).

Two views of one set of weights, in one model. The dense policy (theta, full attention) is the model
the trainer holds, FSDP2-sharded over the ranks or whole in one process; the sparse actor is that
same model run with the teacher-forced block-sparse attention plan and with the adapter on
(`trainer.lora.LoraAdapter`: A/B matrices outside the model's tree, replicated on every rank,
applied by forward hooks only inside `adapter.on()`). So:
  - the dense update and dense scoring run with the adapter off: they cannot see phi, and the
    policy's parameter names, optimizer, checkpoints and published weights stay exactly what they
    are without DistillSparse;
  - the actor follows every dense update for free (no copy, no extra memory beyond phi): an adapter
    trained against policy v_k sits on v_{k+1} as soon as the dense optimizer steps, and is then
    trained further against v_{k+1} (the paper retrains phi after each dense update, warm-started);
  - the sparse side without the adapter (for the with/without probe) is the same forward with it off.

The adapter's loss on a batch of rollouts, teacher-forced with the budgets the generator reported
for each position (`trainer.sparse_attention.recorded_plan`), theta frozen:
    L = L_PPO(sparse + LoRA) + lambda * k3,   k3 = exp(d) - d - 1,  d = clamp(ref - lp, -c, c)
(or, with `kl_estimator="full"`, the exact KL(sparse+LoRA || dense) over the vocabulary at each position)
with lp the sparse+LoRA logprob of each sampled token and ref the dense policy's (detached, from the
policy as it is now, i.e. after this step's dense update: the policy the adapter will be applied
to), plus, when `selection_coef` > 0, that weight times the selection loss of the sparse layers
(`trainer.sparse_attention.selection_loss`: how far the pages' centroid scores are from ranking the
pages by the dense attention mass they hold). L_PPO is the trainer's GRPO + TIS loss
(`trainer.grpo.grpo_tis_loss`) with the sparse actor as the policy: its old logprobs are the actor's
own before this step's update and its TIS weight corrects for the generator's (stale) sampling
distribution.

On several ranks (torch.distributed, FSDP2) every call takes the WHOLE batch, the same on every rank,
and works on this rank's share (`trainer.distributed.share`): each loss is its share of the global
token mean and theta is frozen (`trainer.distributed.frozen`: no gradient of it is computed or
reduced); the adapter's gradients are summed over the ranks before clipping and AdamW, so the
replicated adapters stay identical. Every rank runs as many forwards and backwards as the busiest
one (padding passes over a 2-token rollout), since under FSDP2 each is a collective. The probe's
and `logprobs`' per-rollout results are gathered, in the batch's order, on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sparrow.acceptance import alpha_exact
from sparrow.budget import kept_budget
from trainer import distributed, lm_head, sparse_attention
from trainer.batch import PAD_ROLLOUT, MicroBatch, Rollout, micro_batches, pad_batch
from trainer.grpo import GRPOConfig, global_token_count, grpo_tis_loss
from trainer.lora import LoraAdapter
from trainer.scoring import place, response_hidden
from trainer.sparse_attention import BlockRule

if TYPE_CHECKING:
    from trainer.reference_generate import Generation


@dataclass(frozen=True)
class DistillConfig:
    """The adapter and its optimizer. Defaults, and why:

    - rank 8, alpha 16 (scale alpha / rank = 2): the adapter corrects what sparse attention loses,
      a small change of the attention's projections, so a low rank suffices; it stays below the
      engines' usual `max_lora_rank` (16);
    - targets q, k, v and o projections: the mismatch arises in attention, and k_proj also moves
      the page centroids, so the adapter can change which pages are selected, not only how they mix;
    - lr 1e-5: LoRA's best learning rate sits about ten times above full fine-tuning's, and the
      policy's default is 1e-6; weight decay 0, as for the policy;
    - max_grad_norm 1.0, as for the policy, on the adapter's own gradients;
    - kl_coef (lambda) 1e-3 with d clamped to [-10, 10]: the paper's values;
    - kl_estimator "k3": the paper's, on the sampled tokens. "full" is the exact KL(sparse+LoRA ||
      dense) over the whole vocabulary at each response position: the trainer holds both full
      distributions, and on a small fixed batch the sampled-token estimate can be driven down by
      matching the sampled tokens alone, without the distributions getting any closer;
    - selection_coef 0: the paper's loss. Neither L_PPO nor the KL has a gradient through the top-k
      choice of pages, so where sparse attention fails because the page a token needs was not
      selected (a looked-up fact on an unselected page), no amount of training on them brings the
      page back. The selection loss is differentiable in the queries and the page centroids (through
      q_proj and k_proj): it trains the scores to rank pages as the attention would weigh them
      (see docs/results.md, DistillSparse on `small`, for what it did on `small`);
    - epochs 1: one optimizer step per RL step, as the paper trains phi after each dense update.
    No LoRA dropout: the engines apply none, and the trained actor must be the served one.
    """

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0  # 0 disables clipping
    kl_coef: float = 1e-3
    kl_clamp: float = 10.0
    kl_estimator: str = "k3"  # "k3" (sampled tokens, the paper's) or "full" (exact, every vocabulary entry)
    selection_coef: float = 0.0  # weight of the selection loss (0: the paper's loss)
    epochs: int = 1
    micro_batch_size: int = 8
    temperature: float = 1.0
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    backend: str = "auto"  # page scoring of the teacher-forced forward: the engine's, so both select alike
    seed: int = 0  # initialisation of the LoRA A matrices (B starts at zero: the adapter starts as the identity)
    max_tokens_per_microbatch: int = 0  # padded tokens per micro-batch at most (0: micro_batch_size rows)
    lm_head_chunk: int = lm_head.DEFAULT_CHUNK  # positions per LM-head chunk (trainer/lm_head.py)
    dtype: torch.dtype | None = None  # compute dtype (None or float32: full precision)

    def __post_init__(self) -> None:
        if self.rank < 1 or not self.target_modules:
            raise ValueError("the adapter needs rank >= 1 and at least one target module")
        if not self.lr > 0 or self.epochs < 1 or self.micro_batch_size < 1:
            raise ValueError("lr must be > 0, epochs and micro_batch_size >= 1")
        if self.kl_coef < 0 or self.selection_coef < 0 or not self.kl_clamp > 0 or not self.temperature > 0:
            raise ValueError("kl_coef and selection_coef must be >= 0, kl_clamp and temperature > 0")
        if self.kl_estimator not in ("k3", "full"):
            raise ValueError(f"kl_estimator must be 'k3' or 'full', got {self.kl_estimator!r}")
        if self.max_tokens_per_microbatch < 0 or self.lm_head_chunk < 1:
            raise ValueError("max_tokens_per_microbatch must be >= 0 and lm_head_chunk >= 1")


@dataclass
class Probe:
    """Exact alpha of every probed token against the dense policy, with and without the adapter."""

    kv_lens: torch.Tensor  # [tokens] int64
    with_adapter: torch.Tensor  # [tokens] float32
    without_adapter: torch.Tensor


# A micro-batch with the rollouts of its rows (their budgets make the sparse plan), and whether it only pads.
_Pass = tuple[MicroBatch, list[Rollout], bool]


class DistillSparse:
    """The sparse actor over `policy`'s weights: its LoRA adapter, the adapter's optimizer, training and probes."""

    def __init__(self, policy: torch.nn.Module, config: DistillConfig) -> None:
        self.config = config
        self.policy = sparse_attention.install(policy)
        self.adapter = LoraAdapter(policy, config.rank, config.alpha, config.target_modules, config.seed)
        self.lora_params = list(self.adapter.parameters())
        self.optimizer = torch.optim.AdamW(
            self.lora_params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )

    # -- forwards -------------------------------------------------------------------------------------

    def _sparse_hidden(
        self, mb: MicroBatch, rollouts: Sequence[Rollout], rule: BlockRule, selection: list | None = None
    ) -> torch.Tensor:
        """Last hidden states [tokens, hidden] on the response positions under the rollouts' budgets.

        With the adapter as the caller switched it: on for the sparse actor, off for the sparse policy.
        """
        plan = sparse_attention.recorded_plan(
            mb.prompt_lens,
            [r.kv_budgets for r in rollouts],
            mb.input_ids.shape[1],
            rule.sink,
            rule.local,
            rule.dense_layers,
            self.config.backend,
        )
        if selection is not None:
            plan = dataclasses.replace(plan, selection=selection)
        return response_hidden(self.policy, mb, self.config.dtype, sparrow_plan=plan)

    def _dense_hidden(self, mb: MicroBatch) -> torch.Tensor:
        with self.adapter.off():
            return response_hidden(self.policy, mb, self.config.dtype)

    def _logprobs(self, mb: MicroBatch, rows: torch.Tensor) -> torch.Tensor:
        """[b, T - 1] logprobs of the targets from response hidden states (the policy's head), 0 off the mask."""
        c = self.config
        head = lm_head.token_logprobs(
            rows, self._head(), mb.targets[mb.mask.bool()], c.temperature, c.lm_head_chunk, dtype=c.dtype
        )
        return place(mb, head.logprobs)

    def _head(self) -> torch.Tensor:
        return lm_head.output_weight(self.policy)  # not a LoRA target: the same head on both sides

    def _passes(self, rollouts: Sequence[Rollout], advantages: torch.Tensor | None = None) -> list[_Pass]:
        """This rank's micro-batches of `rollouts` (its share already), then padding up to the busiest rank's count."""
        adv = torch.zeros(len(rollouts)) if advantages is None else advantages
        device = distributed.compute_device(self.policy)
        c = self.config
        own = [
            (mb.to(device), [rollouts[r] for r in mb.rows], False)
            for mb in micro_batches(rollouts, adv, c.micro_batch_size, c.max_tokens_per_microbatch)
        ]
        # Under FSDP2 every forward and backward is a collective: ranks agree on the busiest one's count.
        count = distributed.max_over_ranks(len(own))
        return own + [(pad_batch(device), [PAD_ROLLOUT], True)] * (count - len(own))

    def _per_rollout(self, rollouts: Sequence[Rollout], run: Callable[[MicroBatch, list[Rollout]], list]) -> list:
        """`run` over this rank's share of `rollouts`, a list per micro-batch row; every rollout's item, in order."""
        mine = distributed.share(rollouts)
        local = [rollouts[i] for i in mine]
        out: dict[int, Any] = {}
        for mb, picked, pad in self._passes(local):
            items = run(mb, picked)
            if not pad:
                out.update((mine[r], item) for r, item in zip(mb.rows, items, strict=True))
        whole: dict[int, Any] = {}
        for part in distributed.gather_objects(out):
            whole.update(part)
        return [whole[i] for i in range(len(rollouts))]

    @torch.no_grad()
    def logprobs(
        self, rollouts: Sequence[Rollout], rule: BlockRule, adapter: bool = True, dense: bool = False
    ) -> list[torch.Tensor]:
        """Per rollout, the logprobs of its response tokens: sparse with or without the adapter, or dense."""

        def run(mb: MicroBatch, picked: list[Rollout]) -> list[torch.Tensor]:
            if dense:
                rows = self._dense_hidden(mb)
            else:
                with self.adapter.on() if adapter else self.adapter.off():
                    rows = self._sparse_hidden(mb, picked, rule)
            lp = self._logprobs(mb, rows).cpu()
            return [
                lp[i, p - 1 : p - 1 + n] for i, (p, n) in enumerate(zip(mb.prompt_lens, mb.response_lens, strict=True))
            ]

        return self._per_rollout(rollouts, run)

    # -- training -------------------------------------------------------------------------------------

    def train_step(self, rollouts: Sequence[Rollout], advantages: torch.Tensor, rule: BlockRule) -> dict[str, float]:
        """`epochs` optimizer steps of the adapter on the batch, theta frozen; statistics of the first pass.

        `rollouts` and `advantages` are the whole batch (on several ranks, the same on every rank; each
        trains on its share). The first pass's figures describe the adapter as it came into this step
        (before it saw the batch), over the whole batch: `loss`, `ppo_loss`, `kl` (mean KL estimate per
        token), `tis_clip_fraction`, `tokens`, `selection` (the selection loss before its weight: the
        mean over sparse layers, micro-batches weighted by their tokens; 0 when selection_coef is 0),
        `grad_norm` (of that first step, before clipping).
        """
        c = self.config
        mine = distributed.share(rollouts)
        local = [rollouts[i] for i in mine]
        passes = self._passes(local, advantages[mine])
        device = distributed.compute_device(self.policy)
        num_tokens = global_token_count(torch.tensor([float(sum(len(r.token_ids) for r in local))], device=device))
        refs: list[torch.Tensor | None] = [None] * len(passes)
        if c.kl_estimator == "k3":
            with torch.no_grad():  # the dense policy as it is now, frozen
                refs = [self._logprobs(mb, self._dense_hidden(mb)) for mb, _, _ in passes]
        olds: list[torch.Tensor] = []
        first: dict[str, float] = {}
        keys = ("loss", "ppo_loss", "kl", "selection", "tis_clip_fraction", "tokens")
        with distributed.frozen(self.policy):
            for epoch in range(c.epochs):
                self.optimizer.zero_grad(set_to_none=True)
                totals = dict.fromkeys(keys, 0.0)
                for i, (mb, picked, pad) in enumerate(passes):
                    selection: list | None = [] if c.selection_coef > 0 else None
                    # Forward with the adapter on; the backward runs after the context (a checkpointed layer's
                    # recompute puts the adapter's state back itself, trainer/activation_checkpoint.py).
                    with self.adapter.on():
                        rows = self._sparse_hidden(mb, picked, rule, selection)
                        lp = self._logprobs(mb, rows)
                    if epoch == 0:  # the actor before this step: PPO's old policy
                        olds.append(lp.detach())
                    ppo, stats = grpo_tis_loss(
                        lp, olds[i], mb.rollout_logprobs, mb.advantages, mb.mask, c.grpo, num_tokens
                    )
                    kl = (self._kl_per_token(mb, rows, lp, refs[i]) * mb.mask).sum() / num_tokens
                    loss = ppo + c.kl_coef * kl
                    sel = torch.zeros((), device=loss.device)
                    if selection:
                        sel = torch.stack(selection).mean() * (mb.mask.sum() / num_tokens)
                        loss = loss + c.selection_coef * sel
                    if pad:  # the same forward and backward as the others, nothing added
                        (loss * 0.0).backward()
                        continue
                    loss.backward()
                    for key, value in (("loss", loss), ("ppo_loss", ppo), ("kl", kl), ("selection", sel)):
                        totals[key] += float(value.detach())
                    totals["tis_clip_fraction"] += stats["tis_clip_fraction"] * stats["tokens"]
                    totals["tokens"] += stats["tokens"]
                grad_norm = self._step()
                if epoch == 0:
                    totals = dict(zip(keys, distributed.sum_over_ranks([totals[k] for k in keys]), strict=True))
                    totals["tis_clip_fraction"] /= max(totals["tokens"], 1.0)
                    first = {**totals, "grad_norm": grad_norm}
        return first

    def _step(self) -> float:
        """Sum the adapter's gradients over the ranks, clip them, step AdamW; returns the norm before clipping."""
        for p in self.lora_params:
            if p.grad is None:  # a module no pass reached: every rank still reduces the same tensors
                p.grad = torch.zeros_like(p)
        distributed.all_reduce_sum_([p.grad for p in self.lora_params])
        bound = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.lora_params, bound))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _kl_per_token(
        self, mb: MicroBatch, rows: torch.Tensor, lp: torch.Tensor, ref: torch.Tensor | None
    ) -> torch.Tensor:
        c = self.config
        if c.kl_estimator == "k3":
            d = (ref - lp).clamp(-c.kl_clamp, c.kl_clamp)
            return torch.exp(d) - d - 1.0
        with torch.no_grad():
            dense = self._dense_hidden(mb)
        return place(mb, lm_head.chunked_kl(rows, dense, self._head(), c.temperature, c.lm_head_chunk, c.dtype))

    # -- the probe ------------------------------------------------------------------------------------

    @torch.no_grad()
    def probe(self, rollouts: Sequence[Rollout], rule: BlockRule) -> Probe:
        """Exact alpha (full distributions, at the config's temperature) of every response token vs dense.

        On several ranks each probes its share; every rank gets the whole batch's values, in its order.
        """

        def run(mb: MicroBatch, picked: list[Rollout]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            dense = self._dense_hidden(mb)
            with self.adapter.on():
                with_ = self._alpha_exact(self._sparse_hidden(mb, picked, rule), dense)
            with self.adapter.off():
                without = self._alpha_exact(self._sparse_hidden(mb, picked, rule), dense)
            sizes = list(mb.response_lens)
            return list(zip(torch.split(with_, sizes), torch.split(without, sizes), strict=True))

        rows = self._per_rollout(rollouts, run)
        kv = [r.kv_lens() for r in rollouts]
        cat = lambda parts: torch.cat(parts) if parts else torch.zeros(0)  # noqa: E731
        return Probe(
            torch.cat(kv) if kv else torch.zeros(0, dtype=torch.long),
            cat([w for w, _ in rows]),
            cat([o for _, o in rows]),
        )

    def _alpha_exact(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Exact alpha per response token from two sets of hidden states, a chunk of full distributions at a time."""
        c = self.config
        pairs = zip(
            lm_head.log_distributions(sparse, self._head(), c.temperature, c.lm_head_chunk, c.dtype),
            lm_head.log_distributions(dense, self._head(), c.temperature, c.lm_head_chunk, c.dtype),
            strict=True,
        )
        parts = [alpha_exact(q, p).float().cpu() for (_, q), (_, p) in pairs]
        return torch.cat(parts) if parts else torch.zeros(0)

    # -- saving ---------------------------------------------------------------------------------------

    def save_adapter(self, folder: str | Path) -> None:
        """The adapter in peft format (adapter_config.json, adapter_model.safetensors), as peft and vLLM load it."""
        self.adapter.save(folder)

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors by name (<module>.lora_A.default.weight; detached, on their device)."""
        return self.adapter.tensors()

    def state_dict(self) -> dict[str, Any]:
        """Adapter tensors and optimizer state, keyed by parameter name (torch.distributed.checkpoint's Stateful).

        The tensors are whole on every rank (replicated), so a checkpoint resumes at any world size.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {"lora": self.adapter_tensors(), "optim": get_optimizer_state_dict(self.adapter, self.optimizer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; raises ValueError when the adapter's tensors do not fit."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        mine = self.adapter_tensors()
        lora = state["lora"]
        if set(lora) != set(mine) or any(lora[n].shape != mine[n].shape for n in mine):
            raise ValueError("the checkpointed adapter does not fit this one (rank or target modules differ)")
        with torch.no_grad():
            for name, p in self.adapter.named_parameters():
                p.copy_(lora[name])
        set_optimizer_state_dict(self.adapter, self.optimizer, state["optim"])


def rollout_of(prompt: Sequence[int], generation: Generation, group_id: str = "", sample_index: int = 0) -> Rollout:
    """A reference-loop generation as a rollout, budgets in the generators' convention (0 where dense).

    The reference loop reports the prefill's length for the first token and every decode step's
    budget; a generator reports 0 for the first token and for any budget covering the context.
    """
    plen = len(prompt)
    budgets = tuple(0 if t == 0 else kept_budget(int(b), plen + t) for t, b in enumerate(generation.budgets.tolist()))
    return Rollout(
        group_id=group_id,
        sample_index=sample_index,
        prompt_ids=tuple(prompt),
        token_ids=tuple(generation.tokens),
        logprobs=tuple(generation.scores.logprobs.tolist()),
        top_ids=tuple(tuple(r) for r in generation.scores.top_ids.tolist()),
        top_logprobs=tuple(tuple(r) for r in generation.scores.top_logprobs.tolist()),
        kv_budgets=budgets,
    )
