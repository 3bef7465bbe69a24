"""Evaluation during training: held-out prompts through the generator fleet, scored by the run's rewards.

A round puts every eval prompt (or the first `max_prompts` of each source) on the prompt stream as
a group of `k` samples tagged `eval` in the ledger, once per mode of `modes`, so the generators treat
it as any other group and the step never trains it. Rewards are computed in the reward pool as the
samples arrive. When every group of every mode is complete (or `timeout_s` has passed) the round
reports avg@k and unbiased pass@k per source and mode: Prometheus gauges (label `mode`), one line of
evals.jsonl per mode in the run dir, and the log. Rounds run before the first step, every `every`
steps and after the last step; training goes on while they generate.

Modes: `dense` (the default) asks the generators for dense attention whatever their schedule, so a
sparse schedule does not bias the held-out accuracy; `schedule` decodes under the generators'
current schedule, as the sparse actor samples (never as a probe). A round with both measures what
sparsity costs the policy on held-out prompts: the `schedule` line carries `dense_gap`, dense minus
scheduled for every figure of every source.
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
DENSE, SCHEDULE = "dense", "schedule"  # the modes of [trainer.eval] modes


@dataclass
class _Round:
    number: int
    step: int
    policy_version: int
    groups: dict[str, list[GroupRecord]]  # mode -> its groups
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
        self.rounds = _next_round(self.path)  # continue the numbering
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
        """Enqueue one round's groups (every mode's), for the policy version current now."""
        number = self.rounds
        self.rounds += 1
        groups: dict[str, list[GroupRecord]] = {mode: [] for mode in self.config.modes}
        now = time.time()
        for source in self.data.eval:
            prompts = source.prompts[: self.config.max_prompts] if self.config.max_prompts else source.prompts
            for i, prompt in enumerate(prompts):
                sample = prompt.sample
                # A prompt's modes go on the stream side by side: generated at about the same time, by the same
                # policy version (generators load new ones between groups), the two modes compare like for like.
                for mode in self.config.modes:
                    record = GroupRecord(
                        index=i,
                        group_id=f"{self.run_id}-eval{number:04d}-{mode[0]}-{source.name}-{i:06d}"[:256],
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
                        columns=sample.columns,
                        row_prompt=sample.prompt if isinstance(sample.prompt, str) else list(sample.prompt),
                        purpose=EVAL,
                        dense=mode == DENSE,
                    )
                    self.feeder.add(record)
                    groups[mode].append(record)
        self.pending.append(_Round(number, step, policy_version, groups))
        prompts = len(next(iter(groups.values())))
        log.info("evaluation %d: %d prompts x %d samples (%s) at policy v%d", number, prompts, self.config.k,
                 " and ".join(groups), policy_version)  # fmt: skip

    def poll(self) -> list[dict]:
        """Report every round whose samples are all in (or whose time is up); returns their results, one per
        mode (the round's order of modes)."""
        done = []
        for rnd in list(self.pending):
            everything = [g for groups in rnd.groups.values() for g in groups]
            complete = all(self.store.count(g.group_id) >= g.n for g in everything)
            if complete or time.monotonic() - rnd.started > self.config.timeout_s:
                self.pending.remove(rnd)
                done += self._report(rnd)
        return done

    def _report(self, rnd: _Round) -> list[dict]:
        seconds = round(time.monotonic() - rnd.started, 3)
        results = [self._result(rnd, mode, groups, seconds) for mode, groups in rnd.groups.items()]
        by_mode = {r["mode"]: r for r in results}
        if DENSE in by_mode and SCHEDULE in by_mode:
            by_mode[SCHEDULE]["dense_gap"] = dense_gap(by_mode[DENSE]["sources"], by_mode[SCHEDULE]["sources"])
        everything = [g.group_id for groups in rnd.groups.values() for g in groups]
        self.ledger.finish(everything, EVALUATED)
        self.rewards.forget(everything)
        for result in results:
            self._export(result)
        with self.path.open("a") as f:
            for result in results:
                f.write(json.dumps(result) + "\n")
        self.results += results
        return results

    def _result(self, rnd: _Round, mode: str, groups: list[GroupRecord], seconds: float) -> dict:
        by_source: dict[str, list[list[float]]] = {}
        versions = []
        complete = True
        for g in groups:
            samples = self.store.samples(g.group_id)[: g.n]
            if len(samples) < g.n:
                complete = False
                continue  # an incomplete group has no pass@k; the round says how many came back
            scores = [r.score for r in self.rewards.group_scores(g, samples)]
            by_source.setdefault(g.data_source, []).append(scores)
            versions += [t.versions.policy_version for t in samples]
        return {
            "round": rnd.number,
            "mode": mode,
            "step": rnd.step,
            "policy_version": rnd.policy_version,
            "sample_policy_versions": [min(versions), max(versions)] if versions else [],
            "k": self.config.k,
            "complete": complete,
            "dense": mode == DENSE,
            "prompts": len(groups),
            "sources": {src: summarize(scores) for src, scores in sorted(by_source.items())},
            "seconds": seconds,
        }

    def _export(self, result: dict) -> None:
        mode, k = result["mode"], self.config.k
        for src, figures in result["sources"].items():
            avg = next((v for key, v in figures.items() if key.startswith("avg@")), None)
            if avg is not None:
                self.metrics.eval_avg.labels(source=src, mode=mode).set(avg)
            for key, value in figures.items():
                if key.startswith("pass@"):
                    self.metrics.eval_pass.labels(source=src, k=key[5:], mode=mode).set(value)
        line = " ".join(
            f"{src} avg@{k} {fig.get(f'avg@{k}', float('nan')):.3f} pass@{k} {fig.get(f'pass@{k}', float('nan')):.3f}"
            for src, fig in result["sources"].items()
        )
        gap = " ".join(f"{src} {fig[f'avg@{k}']:+.3f}" for src, fig in result.get("dense_gap", {}).items()
                       if f"avg@{k}" in fig)  # fmt: skip
        log.info("evaluation %d %s (step %d, policy v%d%s): %s%s", result["round"], mode, result["step"],
                 result["policy_version"], "" if result["complete"] else ", timed out", line or "no complete group",
                 f"; dense minus scheduled avg@{k}: {gap}" if gap else "")  # fmt: skip


def dense_gap(dense: dict[str, dict], scheduled: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Dense minus scheduled, per source both measured and per figure (avg@k, pass@j) both have."""
    out = {}
    for src in sorted(set(dense) & set(scheduled)):
        figures = {
            key: dense[src][key] - scheduled[src][key]
            for key in dense[src]
            if key.startswith(("avg@", "pass@")) and key in scheduled[src]
        }
        if figures:
            out[src] = figures
    return out


def _next_round(path: Path) -> int:
    """The number the next round gets: one past the last one evals.jsonl holds (one line per round and mode)."""
    if not path.exists():
        return 0
    last = -1
    for line in path.read_text().splitlines():
        try:
            number = json.loads(line).get("round")
        except (ValueError, AttributeError):
            continue  # a torn line of a trainer killed mid-write
        if isinstance(number, int):
            last = max(last, number)
    return last + 1
