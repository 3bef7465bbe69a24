"""Evaluation during training: held-out prompts through the generator fleet, scored by the run's rewards.

A round puts every eval prompt (or the first `max_prompts` of each source) on the prompt stream as
a group of `k` samples tagged `eval` in the ledger, so the generators treat it as any other group
and the step never trains it. Rewards are computed in the reward pool as the samples arrive. When
every group is complete (or `timeout_s` has passed) the round reports avg@k and unbiased pass@k per
source: Prometheus gauges, one line of evals.jsonl in the run dir, and the log. Rounds run before
the first step, every `every` steps and after the last step; training goes on while they generate.
The samples decode densely (`dense`, the default: the groups ask the generators for dense attention
whatever their schedule, so a sparse schedule does not bias the held-out accuracy), or under the
generators' current schedule, as the sparse actor samples.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.trainer.config import EvalConfig
from services.trainer.feeder import Feeder
from services.trainer.ledger import EVAL, EVALUATED, GroupLedger, GroupRecord
from services.trainer.metrics import TrainerMetrics
from services.trainer.rewarding import RewardScorer
from services.trainer.store import TrajectoryStore
from services.trainer.training_data import TrainingData
from sparrow.evaluation import summarize
from sparrow.work import Sampling

log = logging.getLogger("sparrow.trainer.eval")

EVALS_FILE = "evals.jsonl"


@dataclass
class _Round:
    number: int
    step: int
    policy_version: int
    groups: list[GroupRecord]
    started: float = field(default_factory=time.monotonic)


class Evaluator:
    """Starts evaluation rounds and reports each when its samples are in."""

    def __init__(
        self,
        config: EvalConfig,
        data: TrainingData,
        run_id: str,
        feeder: Feeder,
        ledger: GroupLedger,
        store: TrajectoryStore,
        rewards: RewardScorer,
        metrics: TrainerMetrics,
        run_dir: Path,
        sampling: Sampling,
    ) -> None:
        self.config = config
        self.data = data
        self.run_id = run_id
        self.feeder = feeder
        self.ledger = ledger
        self.store = store
        self.rewards = rewards
        self.metrics = metrics
        self.path = Path(run_dir) / EVALS_FILE
        self.sampling = sampling
        self.pending: list[_Round] = []
        self.rounds = sum(1 for _ in self.path.open()) if self.path.exists() else 0  # continue the numbering
        self.results: list[dict] = []
        # Rounds a crash cut short are not resumed: their groups are closed, not left waiting for ever.
        orphans = [r.group_id for r in ledger.outstanding(EVAL)]
        if orphans:
            ledger.finish(orphans, EVALUATED)
            log.warning("closed %d eval group(s) of a round cut short by the last stop", len(orphans))

    @property
    def enabled(self) -> bool:
        """Whether there is an eval set and evaluation is on."""
        return bool(self.data.eval) and self.config.every > 0

    def due(self, step: int, last_step: int) -> bool:
        """Whether a round starts after `step` steps (0: before the first)."""
        return self.enabled and (step % self.config.every == 0 or (last_step > 0 and step == last_step))

    def start(self, step: int, policy_version: int) -> None:
        """Enqueue one round's groups, for the policy version current now."""
        number = self.rounds
        self.rounds += 1
        groups = []
        now = time.time()
        for source in self.data.eval:
            prompts = source.prompts[: self.config.max_prompts] if self.config.max_prompts else source.prompts
            for i, prompt in enumerate(prompts):
                sample = prompt.sample
                record = GroupRecord(
                    index=i,
                    group_id=f"{self.run_id}-eval{number:04d}-{source.name}-{i:06d}"[:256],
                    prompt_token_ids=prompt.token_ids,
                    n=self.config.k,
                    answer=sample.ground_truth,
                    policy_version=policy_version,
                    max_new_tokens=self.sampling.max_new_tokens,
                    prompt_text=prompt.text,
                    created_at=now,
                    data_source=sample.data_source,
                    reward=self.data.rewards[sample.data_source],
                    extras=sample.extras,
                    purpose=EVAL,
                    dense=self.config.dense,
                )
                self.feeder.add(record)
                groups.append(record)
        self.pending.append(_Round(number, step, policy_version, groups))
        log.info("evaluation %d: %d prompts x %d samples at policy v%d", number, len(groups), self.config.k,
                 policy_version)  # fmt: skip

    def poll(self) -> list[dict]:
        """Report every round whose samples are all in (or whose time is up); returns their results."""
        done = []
        for rnd in list(self.pending):
            complete = all(self.store.count(g.group_id) >= g.n for g in rnd.groups)
            if complete or time.monotonic() - rnd.started > self.config.timeout_s:
                self.pending.remove(rnd)
                done.append(self._report(rnd, complete))
        return done

    def _report(self, rnd: _Round, complete: bool) -> dict:
        by_source: dict[str, list[list[float]]] = {}
        versions = []
        for g in rnd.groups:
            samples = self.store.samples(g.group_id)[: g.n]
            if len(samples) < g.n:
                continue  # an incomplete group has no pass@k; the round says how many came back
            scores = [r.score for r in self.rewards.group_scores(g, samples)]
            by_source.setdefault(g.data_source, []).append(scores)
            versions += [t.versions.policy_version for t in samples]
        self.ledger.finish([g.group_id for g in rnd.groups], EVALUATED)
        self.rewards.forget([g.group_id for g in rnd.groups])
        sources = {src: summarize(groups) for src, groups in sorted(by_source.items())}
        result = {
            "round": rnd.number,
            "step": rnd.step,
            "policy_version": rnd.policy_version,
            "sample_policy_versions": [min(versions), max(versions)] if versions else [],
            "k": self.config.k,
            "complete": complete,
            "dense": self.config.dense,
            "prompts": len(rnd.groups),
            "sources": sources,
            "seconds": round(time.monotonic() - rnd.started, 3),
        }
        for src, figures in sources.items():
            avg = next((v for key, v in figures.items() if key.startswith("avg@")), None)
            if avg is not None:
                self.metrics.eval_avg.labels(source=src).set(avg)
            for key, value in figures.items():
                if key.startswith("pass@"):
                    self.metrics.eval_pass.labels(source=src, k=key[5:]).set(value)
        with self.path.open("a") as f:
            f.write(json.dumps(result) + "\n")
        self.results.append(result)
        line = " ".join(
            f"{src} avg@{self.config.k} {fig.get(f'avg@{self.config.k}', float('nan')):.3f} "
            f"pass@{self.config.k} {fig.get(f'pass@{self.config.k}', float('nan')):.3f}"
            for src, fig in sources.items()
        )
        log.info("evaluation %d (step %d, policy v%d%s): %s", rnd.number, rnd.step, rnd.policy_version,
                 "" if complete else ", timed out", line or "no complete group")  # fmt: skip
        return result
