"""One training step: pick complete groups, drop stale ones, reward, score densely, measure alpha, update.

A group is ready when all its `n` samples are stored. One whose oldest sample's policy version
lags the current policy by more than `max_staleness` versions is dropped (counted, never trained).
The rest, oldest first, make the batch: rewards (each group's own, by its data_source, computed in
the reward pool as the trajectories arrived; services/trainer/rewarding.py) against the answers the
ledger kept, dense teacher-forced logprobs and top-k (the trainer's own model, dense attention, no
adapter), alpha per token against the generators' top-k, the tail metrics per KV-length bin, and
one GRPO + TIS update (trainer/rl_update.py, written for FSDP2 as well).
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from services.api.sparrow.v1 import rollout_pb2
from services.trainer.ledger import DROPPED, GroupLedger
from services.trainer.metrics import TrainerMetrics
from services.trainer.rewarding import RewardScorer
from services.trainer.store import TrajectoryStore
from sparrow import metrics_contract as mc
from sparrow.acceptance import binned_stats
from trainer.batch import Rollout
from trainer.exact_alpha import ExactAlpha
from trainer.grpo import group_advantages
from trainer.rl_update import UpdateConfig, learn
from trainer.scoring import Scorer

if TYPE_CHECKING:
    from services.trainer.distill_step import DistillStep, StepRule
    from services.trainer.ranks import Leader
    from sparrow.timing import PhaseTimer

log = logging.getLogger("sparrow.trainer.step")


@dataclass
class StepReport:
    """The figures of one step, logged, exported and written to steps.jsonl."""

    step: int
    policy_version: int  # the version trained from; the step publishes policy_version + 1
    groups: list[str]
    samples: int
    reward_mean: float
    accuracy: float
    response_length: float
    staleness: float
    alpha_mean: float
    # {bin, kv_start, tokens, mean, p5, p1, under_half} of the top-k bound, probe samples left out; with the
    # exact pass also {exact_tokens, exact_mean, exact_p5, exact_p1, exact_under_half}
    alpha_bins: list[dict] = field(default_factory=list)
    probe_samples: int = 0  # samples generated at the controller's probe budgets
    alpha_probe_bins: list[dict] = field(default_factory=list)  # the same over the probe samples' tokens
    tis_clip_fraction: float = 0.0
    kl_rollout_dense: float = 0.0
    ppo_clip_fraction: float = 0.0
    loss: float = 0.0
    grad_norm: float = 0.0
    schedule_version: int = 0
    seconds: float = 0.0  # the whole step: scoring, update, publishing and any checkpoint
    exact_seconds: float = 0.0  # of `seconds`, the exact-alpha pass's ([trainer] alpha = "exact"; 0 without it)
    distill: dict = field(default_factory=dict)  # the adapter's figures (services/trainer/distill_step.py)
    reward_by_source: dict = field(default_factory=dict)  # data_source -> mean reward of its samples
    reward_errors: int = 0  # samples scored 0 because their reward timed out, raised or returned no finite score
    # reward -> {field: mean}: the number fields a dict reward returned beside its score, over the samples with them
    reward_extra: dict = field(default_factory=dict)
    finished_stop: int = 0  # samples that ended at a stop id (an eos of the model or the config)
    finished_length: int = 0  # samples that ran to max_new_tokens
    finished_other: int = 0  # neither: a generator that stopped elsewhere (never expected)
    # Where the step's wall time went (sparrow.timing): phase -> seconds, `other` included, summing to
    # `wall_seconds`, the time from the end of the previous step (or the loop's start) to the end of this one.
    timing: dict = field(default_factory=dict)
    wall_seconds: float = 0.0

    def to_dict(self) -> dict:
        """The record of steps.jsonl: the fields, with `timing` flat as `timing/<phase>` keys."""
        out = asdict(self)
        for name, seconds in out.pop("timing").items():
            out[mc.TIMING_PREFIX + name] = seconds
        return out


def _untimed(_name: str) -> nullcontext:
    return nullcontext()


def _budgets(r: Rollout) -> torch.Tensor:
    """The KV budget of each of the rollout's tokens (0 = dense; all 0 when the generator sent none)."""
    if len(r.kv_budgets) == len(r.token_ids):
        return torch.tensor(r.kv_budgets, dtype=torch.long)
    return torch.zeros(len(r.token_ids), dtype=torch.long)


def _bin_rows(alpha: torch.Tensor, kv_lens: torch.Tensor, tail) -> list[dict]:
    """The report's per-bin rows of one set of alpha values."""
    return [
        {"bin": b.index, "kv_start": b.kv_start, "tokens": b.count, "mean": b.mean, "p5": b.quantile, "p1": b.p1,
         "under_half": b.under_half}
        for b in binned_stats(alpha, kv_lens, tail.bin_width, tail.quantile, tail.num_bins)
    ]  # fmt: skip


def to_rollout(t: rollout_pb2.Trajectory) -> Rollout:
    """The learner's view of a wire trajectory."""
    return Rollout(
        group_id=t.group_id,
        sample_index=t.sample_index,
        prompt_ids=tuple(t.prompt_token_ids),
        token_ids=tuple(t.token_ids),
        logprobs=tuple(t.logprobs),
        top_ids=tuple(tuple(top.token_ids) for top in t.top_logprobs),
        top_logprobs=tuple(tuple(top.logprobs) for top in t.top_logprobs),
        kv_budgets=tuple(t.kv_budgets),
        policy_version=t.versions.policy_version,
        schedule_version=t.versions.schedule_version,
        probe=t.probe,
        adapter_version=t.versions.adapter_version,
    )


class StepRunner:
    """Selects each step's groups and trains on them."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        rewards: RewardScorer,
        store: TrajectoryStore,
        ledger: GroupLedger,
        metrics: TrainerMetrics,
        update: UpdateConfig,
        groups_per_step: int,
        max_staleness: int,
        distill: DistillStep | None = None,
        stop_ids: tuple[int, ...] = (),
        exact: ExactAlpha | None = None,
        leader: Leader | None = None,
        rule: StepRule | None = None,
    ) -> None:
        self.exact = exact  # the exact-alpha pass ([trainer] alpha = "exact"), None: the top-k bound only
        self.stop_ids = frozenset(stop_ids)  # where a sample may end before max_new_tokens
        self.model = model
        self.optimizer = optimizer
        # The policy itself, dense attention: the "old" logprobs of this step.
        self.scorer = Scorer(model, chunk=update.lm_head_chunk, dtype=update.dtype)
        self.rewards = rewards
        self.store = store
        self.ledger = ledger
        self.metrics = metrics
        self.update = update
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.distill = distill  # trains the sparse actor's adapter after each dense update
        self._alpha_bins: set[int] = set()
        self.leader = leader  # under torchrun: hands the batch to the other ranks
        self.rule = rule  # the block rule of the exact pass and the adapter, read once per step

    def collect(self, policy_version: int) -> tuple[list[str] | None, list[str]]:
        """(the next batch's group ids or None when not enough are complete, groups dropped as stale now)."""
        ready, stale = [], []
        for record in self.ledger.outstanding():
            if self.store.count(record.group_id) < record.n:
                continue
            oldest = min(t.versions.policy_version for t in self.store.samples(record.group_id))
            if policy_version - oldest > self.max_staleness:
                stale.append(record.group_id)
                continue
            if len(ready) < self.groups_per_step:
                ready.append(record.group_id)
        if stale:
            self.ledger.finish(stale, DROPPED)
            self.rewards.forget(stale)
            self.metrics.dropped_stale.inc(len(stale))
            log.warning("dropped %d stale group(s) (lag > %d versions)", len(stale), self.max_staleness)
        return (ready if len(ready) == self.groups_per_step else None), stale

    def waiting_for(self) -> str:
        """Why no batch is ready: the outstanding groups and how many of their samples are stored, the
        reward workers' state; logged while a step waits long and named by tests that time out."""
        outstanding = self.ledger.outstanding()
        counts = [(self.store.count(r.group_id), r.n) for r in outstanding]
        complete = sum(have >= n for have, n in counts)
        partial = " ".join(f"{have}/{n}" for have, n in counts if have < n)
        return (
            f"{complete} of {self.groups_per_step} groups complete; {len(outstanding)} outstanding"
            f"{f' (samples stored {partial})' if partial else ''}; reward workers: {self.rewards.pool.describe()}"
        )

    def run(self, step: int, policy_version: int, group_ids: list[str], phases: PhaseTimer | None = None) -> StepReport:
        """Train on the groups (taken from the ledger by the caller); export and return the step's figures.

        With `phases` the step's time is charged to its `reward`, `score`, `exact_alpha`, `update` and
        `distill` phases (sparrow.timing)."""
        start = time.monotonic()
        timed = phases.phase if phases is not None else _untimed
        rollouts, rewards, advantages = [], [], []
        by_source: dict[str, list[float]] = {}
        extra: dict[str, dict[str, list[float]]] = {}
        errors = 0
        ends = {"stop": 0, "length": 0, "other": 0}
        for gid in group_ids:
            record = self.ledger.get(gid)
            samples = self.store.samples(gid)
            with timed("reward"):
                results = self.rewards.group_scores(record, samples)
            group_rewards = [r.score for r in results]
            errors += sum(r.error is not None for r in results)
            for r in results:
                for name, value in r.info.items():
                    extra.setdefault(record.reward, {}).setdefault(name, []).append(value)
            by_source.setdefault(record.data_source, []).extend(group_rewards)
            for t in samples:
                if t.token_ids and t.token_ids[-1] in self.stop_ids:
                    ends["stop"] += 1
                elif len(t.token_ids) >= record.max_new_tokens:
                    ends["length"] += 1
                else:
                    ends["other"] += 1
            rollouts += [to_rollout(t) for t in samples]
            rewards += group_rewards
            advantages.append(group_advantages(torch.tensor(group_rewards), len(samples), self.update.grpo.adv_eps))
        # Dense scores, alpha of the whole batch and the update; each rank its share when distributed.
        adv = torch.cat(advantages)
        rule = self.rule.refresh() if self.rule is not None else None
        if self.leader is not None:
            from services.trainer.ranks import TRAIN, TrainOrder

            self.leader.order(TRAIN, TrainOrder(rollouts, adv, step, rule))
        _, acc, stats = learn(self.model, self.optimizer, self.scorer, rollouts, adv, self.update, self.exact, phases)
        distilled = {}
        if self.distill is not None:
            with timed("distill"):
                distilled = self.distill.run(step, rollouts, adv)
        schedule_version = min(r.schedule_version for r in rollouts)
        tail = self.metrics.tail
        # Probe sequences ran at the controller's probe budgets: their tokens describe those budgets,
        # not the schedule's, and are exported apart.
        probing = torch.cat([torch.full((len(r.token_ids),), r.probe, dtype=torch.bool) for r in rollouts])
        main = ~probing
        exact = acc.exact
        exact_main = exact[main] if exact is not None else None
        tail.record_step(acc.alpha[main], acc.kv_lens[main], schedule_version, exact_main)
        budgets = torch.cat([_budgets(r) for r in rollouts])
        # Probes follow the trainer's alpha: exact where the pass has it, the bound for the tokens it has not.
        probe_alpha = acc.alpha.double() if exact is None else torch.where(exact.isnan(), acc.alpha.double(), exact)
        tail.record_probe(probe_alpha[probing], acc.kv_lens[probing], budgets[probing])
        bins = _bin_rows(acc.alpha[main], acc.kv_lens[main], tail)
        if exact is not None:
            have = main & ~exact.isnan()
            by_bin = {b["bin"]: b for b in _bin_rows(exact[have], acc.kv_lens[have], tail)}
            for row in bins:
                other = by_bin.get(row["bin"], {})
                row.update({f"exact_{k}": other.get(k, math.nan) for k in ("tokens", "mean", "p5", "p1", "under_half")})
        probe_bins = _bin_rows(probe_alpha[probing], acc.kv_lens[probing], tail)
        report = StepReport(
            step=step,
            policy_version=policy_version,
            groups=list(group_ids),
            samples=len(rollouts),
            reward_mean=sum(rewards) / len(rewards),
            accuracy=sum(r == 1.0 for r in rewards) / len(rewards),
            response_length=sum(len(r.token_ids) for r in rollouts) / len(rollouts),
            staleness=sum(policy_version - r.policy_version for r in rollouts) / len(rollouts),
            alpha_mean=float(acc.alpha.double().mean()),
            alpha_bins=bins,
            probe_samples=sum(r.probe for r in rollouts),
            alpha_probe_bins=probe_bins,
            tis_clip_fraction=stats.get("tis_clip_fraction", 0.0),
            kl_rollout_dense=stats.get("kl_rollout_dense", 0.0),
            ppo_clip_fraction=stats.get("ppo_clip_fraction", 0.0),
            loss=stats.get("loss", 0.0),
            grad_norm=stats.get("grad_norm", 0.0),
            schedule_version=schedule_version,
            seconds=time.monotonic() - start,
            exact_seconds=acc.exact_seconds,
            distill=distilled,
            reward_by_source={src: sum(v) / len(v) for src, v in sorted(by_source.items())},
            reward_errors=errors,
            reward_extra={
                reward: {name: sum(v) / len(v) for name, v in sorted(fields.items())}
                for reward, fields in sorted(extra.items())
            },
            finished_stop=ends["stop"],
            finished_length=ends["length"],
            finished_other=ends["other"],
        )
        self._export(report)
        return report

    def _export(self, r: StepReport) -> None:
        m = self.metrics
        m.reward_mean.set(r.reward_mean)
        for reward, fields in r.reward_extra.items():
            for name, value in fields.items():
                m.reward_extra.labels(reward=reward, field=name).set(value)
        m.accuracy.set(r.accuracy)
        m.response_length.set(r.response_length)
        m.tis_clip.set(r.tis_clip_fraction)
        m.kl.set(r.kl_rollout_dense)
        m.staleness.set(r.staleness)
        now = {b["bin"]: b["mean"] for b in r.alpha_bins}
        # A bin this step left empty reads NaN, as the p5 gauge does: no stale mean is mistaken for a fresh one.
        for index in sorted(self._alpha_bins | set(now)):
            m.alpha_mean.labels(**{mc.BIN_LABEL: mc.bin_label(index)}).set(now.get(index, math.nan))
        self._alpha_bins |= set(now)
