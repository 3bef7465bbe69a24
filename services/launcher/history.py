"""The run's metrics history: one row per training step, in RUN_DIR/metrics.jsonl.

A row joins the trainer's own record of the step (trainer/steps.jsonl: reward, accuracy, response
length, exact p5 per bin, versions) with what the launcher reads when it sees that step: the
generators' counters (tokens, engine time, versions), the schedule in force (Redis, or the fixed one),
its predicted speedup, and PromQL's p5 per bin (what the controller acts on). The progress view,
`--json` and the report all read these rows and nothing else.

Evaluation rounds (trainer/evals.jsonl) get rows of their own in the same file, `"kind": "eval"`,
one per round and mode, in the order they ended among the step rows: the round, its mode (`dense` or
`schedule`), the step it ran after (0: before the first), the policy version, avg@k/pass@k per
source, and on the `schedule` row of a round with both modes `dense_gap` (dense minus scheduled). This module
writes the file; `report.history` reads it (`read_history`: the step rows, `read_eval_history`: the eval rows).

A resumed run (`sparrow up --resume`) carries on the same file: the rows written before are the run's
so far, and the trainer's records are read on from where the last launcher had read them
(RUN_DIR/history.json, written after every append), so a step it had recorded but the last launcher
never saw gets its row, and none is written twice except the one a kill could fall between.

Throughput is measured between two rows: `tokens_per_s` is generated tokens per wall second (all
generators), `rollout_tokens_per_s` is tokens per second of engine step time summed over generators
(what the cluster generates while generating, whatever the trainer's pace). The generators count tokens
in the engine step that generates them, as the engine time accrues, so a window of any length between
two rows reads the rate of that window (counting a sequence's tokens when it finished made a steady
workload swing from one row to the next).

Where the time went: the trainer's split of the step (`timing/<phase>` seconds, summing to
`step_wall_seconds`, from steps.jsonl) and the generators' loop time by phase over the same window as the
throughput, summed over generators (`generator_timing`: phase -> seconds).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from report.history import EVAL_KIND, HISTORY_FILE, read_eval_history, read_history, supersede
from services.launcher.scrape import GeneratorSample, promql_p5, read_schedule, scrape_generator
from services.trainer.store import replace_text
from sparrow import metrics_contract as mc

READ_FILE = "history.json"  # how far the launcher has read the trainer's records (a resume reads on from there)
STEPS_FILE = "steps.jsonl"  # written by the trainer in its run folder


@dataclass
class HistorySources:
    """Where a row's figures come from."""

    steps_file: Path
    generator_metrics: dict[str, str]  # generator name -> /metrics URL
    redis_client: object | None
    prometheus_url: str | None
    promql_window_s: float
    tau: float
    initial_schedule: dict | None  # the fixed schedule (None: dense)
    follow_redis: bool  # the schedule in Redis governs (False: dense or fixed)
    speedup_of: Callable[[dict | None], float | None]  # the cost model's prediction for a schedule
    evals_file: Path | None = None  # the trainer's evaluation rounds (None: none are followed)


class History:
    """Turns new trainer steps into rows and appends them to the history file."""

    def __init__(self, run_dir: Path, sources: HistorySources, resume: bool = False) -> None:
        self.path = run_dir / HISTORY_FILE
        self._read_file = run_dir / READ_FILE
        self.sources = sources
        self.started = time.time()
        self._offset = 0  # bytes of steps.jsonl consumed
        self._evals_offset = 0  # bytes of evals.jsonl consumed
        self.eval_rows: list[dict] = []
        self._last: dict[str, GeneratorSample] = {}
        self._last_time = time.monotonic()
        self.rows: list[dict] = []  # the run as it stands: each step's last training (`supersede`)
        self.generator_versions: dict[str, int] = {}  # newest policy version each generator served
        if resume:
            self._carry_on(run_dir)

    def _carry_on(self, run_dir: Path) -> None:
        """The run so far: its rows, how far its records were read, its clock (elapsed_s goes on)."""
        self.rows = read_history(run_dir)
        self.eval_rows = read_eval_history(run_dir)
        try:
            read = json.loads(self._read_file.read_text())
            self._offset, self._evals_offset = int(read["steps"]), int(read["evals"])
        except (OSError, ValueError, KeyError, TypeError):
            # No record of how far (a launcher killed before its first row): what the rows hold was read.
            self._offset = _size(self.sources.steps_file) if self.rows else 0
            self._evals_offset = _size(self.sources.evals_file) if self.eval_rows else 0
        last = [r.get("elapsed_s") for r in self.rows + self.eval_rows if isinstance(r.get("elapsed_s"), int | float)]
        if last:
            self.started -= max(last)

    def _record_read(self) -> None:
        replace_text(self._read_file, json.dumps({"steps": self._offset, "evals": self._evals_offset}) + "\n")

    def poll(self) -> list[dict]:
        """Rows for the steps the trainer finished since the last call (evaluation rounds that ended since
        are written to the file too, before those steps' rows, and kept in `eval_rows`)."""
        evals = [self._eval_row(r) for r in self._new_lines("_evals_offset", self.sources.evals_file, "round")]
        if evals:
            with self.path.open("a") as f:
                for row in evals:
                    f.write(json.dumps(row) + "\n")
            self.eval_rows += evals
            self._record_read()
        steps = self._new_steps()
        if not steps:
            return []
        throughput = self._throughput()
        schedule, speedup = self._schedule()
        promql = (
            promql_p5(self.sources.prometheus_url, self.sources.promql_window_s) if self.sources.prometheus_url else {}
        )
        rows = []
        for i, step in enumerate(steps):
            last = i == len(steps) - 1
            rows.append(self._row(step, throughput if last else {}, schedule, speedup, promql if last else {}))
        with self.path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        self._record_read()
        for row in rows:
            supersede(self.rows, row)
        return rows

    def sample_generators(self) -> dict[str, int]:
        """Scrape every generator once more (the run's end); returns their policy versions."""
        self._throughput()
        return dict(self.generator_versions)

    def _new_steps(self) -> list[dict]:
        return self._new_lines("_offset", self.sources.steps_file, "step")

    def _new_lines(self, offset_attr: str, path: Path | None, key: str) -> list[dict]:
        """The records appended to `path` since the last call (those with an integer `key`)."""
        if path is None:
            return []
        try:
            with path.open("rb") as f:
                f.seek(getattr(self, offset_attr))
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line the trainer is still writing waits for the next poll
        setattr(self, offset_attr, getattr(self, offset_attr) + end)
        records = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # not a record: skipped rather than stopping the run
            if isinstance(record, dict) and isinstance(record.get(key), int) and isinstance(record.get("step", 0), int):
                records.append(record)
        return records

    def _eval_row(self, rnd: dict) -> dict:
        return {
            "kind": EVAL_KIND,
            "step": rnd.get("step", 0),
            "round": rnd["round"],
            "time": time.time(),
            "elapsed_s": round(time.time() - self.started, 3),
            "policy_version": rnd.get("policy_version"),
            "k": rnd.get("k"),
            # A round of a trainer from before eval.modes has `dense` only.
            "mode": rnd.get("mode") or ("dense" if rnd.get("dense", True) else "schedule"),
            "dense": rnd.get("dense"),
            "complete": rnd.get("complete"),
            "prompts": rnd.get("prompts"),
            "sources": rnd.get("sources", {}),
            **({"dense_gap": rnd["dense_gap"]} if "dense_gap" in rnd else {}),
            "eval_seconds": rnd.get("seconds"),
        }

    def _throughput(self) -> dict:
        now = time.monotonic()
        wall = now - self._last_time
        self._last_time = now
        tokens = sparse = busy_rate = attended = context = 0.0
        phases: dict[str, float] = {}
        versions: dict[str, int] = {}
        adapters: dict[str, int] = {}
        for name, url in self.sources.generator_metrics.items():
            sample = scrape_generator(url)
            if sample is None:
                continue  # gone (killed, stopping): its counters stop counting
            prev = self._last.get(name, GeneratorSample())
            self._last[name] = sample
            d_tokens = _delta(sample.tokens, prev.tokens)
            d_busy = _delta(sample.busy_s, prev.busy_s)
            tokens += d_tokens
            sparse += _delta(sample.tokens_sparse, prev.tokens_sparse)
            attended += _delta(sample.attended_kv, prev.attended_kv)
            context += _delta(sample.context_kv, prev.context_kv)
            if d_busy > 0:
                busy_rate += d_tokens / d_busy
            for phase, seconds in sample.phases.items():
                phases[phase] = phases.get(phase, 0.0) + _delta(seconds, prev.phases.get(phase, 0.0))
            versions[name] = sample.policy_version
            adapters[name] = sample.adapter_version
            self.generator_versions[name] = max(self.generator_versions.get(name, 0), sample.policy_version)
        return {
            "generated_tokens": tokens,
            # No tokens between two scrapes is no measurement (the step's groups were generated earlier), not 0/s.
            "tokens_per_s": tokens / wall if wall > 0 and tokens else None,
            "rollout_tokens_per_s": busy_rate if tokens else None,
            "sparse_token_fraction": sparse / tokens if tokens else None,
            "attended_kv_fraction": attended / context if context else None,
            "generator_policy_versions": versions,
            "generator_adapter_versions": adapters,
            "generator_timing": {p: round(v, 6) for p, v in phases.items()},
        }

    def _schedule(self) -> tuple[dict | None, float | None]:
        s = self.sources
        schedule, speedup = None, None
        if s.follow_redis and s.redis_client is not None:
            schedule, speedup = read_schedule(s.redis_client)
        if schedule is None:
            schedule, speedup = s.initial_schedule, None
        if speedup is None:
            speedup = s.speedup_of(schedule)
        return schedule, speedup

    def _row(self, step: dict, throughput: dict, schedule: dict | None, speedup: float | None, promql: dict) -> dict:
        bins = step.get("alpha_bins", [])
        probes = step.get("alpha_probe_bins", [])
        return {
            "step": step["step"],
            "time": time.time(),
            "elapsed_s": round(time.time() - self.started, 3),
            "reward": step.get("reward_mean"),
            "accuracy": step.get("accuracy"),
            "reward_extra": step.get("reward_extra", {}),
            "response_length": step.get("response_length"),
            "samples": step.get("samples"),
            "alpha_mean": step.get("alpha_mean"),
            "p5": {str(b["bin"]): b["p5"] for b in bins},
            "alpha_tokens": {str(b["bin"]): b["tokens"] for b in bins},
            "p5_promql": promql,
            "probe_samples": step.get("probe_samples", 0),
            "probe_p5": {str(b["bin"]): b["p5"] for b in probes},
            "tau": self.sources.tau,
            "policy_version": step.get("policy_version"),
            "published_version": step.get("published_version"),
            "trained_schedule_version": step.get("schedule_version"),
            "schedule_version": schedule.get("version", 0) if schedule else 0,
            "schedule_budgets": list(schedule["budgets"]) if schedule else None,
            "bin_width": schedule.get("bin_width") if schedule else None,
            "predicted_speedup": speedup,
            "generated_tokens": throughput.get("generated_tokens"),
            "tokens_per_s": throughput.get("tokens_per_s"),
            "rollout_tokens_per_s": throughput.get("rollout_tokens_per_s"),
            "sparse_token_fraction": throughput.get("sparse_token_fraction"),
            "attended_kv_fraction": throughput.get("attended_kv_fraction"),
            "generator_policy_versions": throughput.get("generator_policy_versions", {}),
            "generator_adapter_versions": throughput.get("generator_adapter_versions", {}),
            "staleness": step.get("staleness"),
            "kl_rollout_dense": step.get("kl_rollout_dense"),
            "tis_clip_fraction": step.get("tis_clip_fraction"),
            "step_seconds": step.get("seconds"),
            "step_wall_seconds": step.get("wall_seconds"),
            **{k: v for k, v in step.items() if k.startswith(mc.TIMING_PREFIX)},
            "generator_timing": throughput.get("generator_timing", {}),
        }


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def _delta(now: float, before: float) -> float:
    # A counter that went down belongs to a restarted process: everything it counted is new.
    return now - before if now >= before else now
