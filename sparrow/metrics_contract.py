"""Names shared between the services that write and read the tail statistic and the schedule.

The trainer exports per-token acceptance (alpha) per length bin under these Prometheus names; the
controller reads them back with PromQL, retunes the schedule and publishes it under the Redis keys
below, which the generators read. Both sides import this module, so a rename breaks both at once
instead of silently disconnecting them. Plain strings only: the core stays free of Redis and HTTP.

Prometheus (written by the trainer, read by the controller):

- ``sparrow_trainer_alpha`` histogram, label ``bin``: every scored token's alpha, buckets
  ``ALPHA_BUCKETS`` (dense near 1, where the tail lives), so that
  ``histogram_quantile(0.05, sum by (le, bin) (rate(sparrow_trainer_alpha_bucket[W])))`` is the p5.
- ``sparrow_trainer_alpha_p5`` gauge, label ``bin``: the exact 5th percentile of alpha over the
  last step's tokens of that bin (NaN when the step had none).
- ``sparrow_trainer_alpha_tokens`` gauge, label ``bin``: how many tokens the exact p5 is over (0
  when none; the controller ignores bins below its `min_tokens`).
- ``sparrow_trainer_schedule_version`` gauge: the *oldest* schedule version behind the last
  step's tokens. A bin's data counts as produced under its current budget only once this reaches
  the version in which that budget was set.
- ``sparrow_trainer_alpha_steps_total`` counter: steps whose tokens were recorded. A new value
  means the gauges above hold a new step's reading, even when it equals the last one (p5 of 1.0
  over a bin's 4,096 tokens, step after step, is the usual case for a lenient schedule).

Beside p5, per bin, over the same last step: ``sparrow_trainer_alpha_p1`` (the 1st percentile) and
``sparrow_trainer_alpha_under_half`` (the share of tokens with alpha < 0.5), which see rare failing
tokens under the 5% that p5 looks at.

All of the above is the top-k bound of alpha (the generators' top-20 lists against the trainer's). A
trainer with ``alpha = "exact"`` also exports the exact value (its own teacher-forced sparse forward
against its dense one, over the whole vocabulary) as series of their own: ``sparrow_trainer_alpha_exact``
(histogram), ``sparrow_trainer_alpha_exact_p5``, ``_exact_p1``, ``_exact_under_half`` and
``_exact_tokens``; `alpha_series` names both sets. The controller reads the one its config names.

Optional probes (written by the trainer only for tokens generated under a probe request):
``sparrow_trainer_alpha_probe_p5``, ``sparrow_trainer_alpha_probe_tokens`` and
``sparrow_trainer_alpha_probe_budget_tokens`` (the probe budget those tokens used), label ``bin``.

Redis (written by the controller, read by the generators; Redis is the source of truth):

- ``SCHEDULE_KEY``: the current schedule, its JSON form (``Schedule.to_json``), version inside.
- ``SCHEDULE_HISTORY_KEY``: a list of JSON entries, oldest first, one per published version:
  ``{"version", "schedule", "reason", "source", "decisions", "predicted_speedup", "time"}``.
- ``SCHEDULE_UPDATES_CHANNEL``: pub/sub; each publish sends the new schedule's JSON. A subscriber
  that (re)connects must read ``SCHEDULE_KEY`` since messages sent while it was away are lost.
- ``PROBE_KEY``: optional probe request, JSON ``{"schedule_version", "share", "budgets",
  "expires_at"}``: for a ``share`` of new sequences, use ``budgets[i]`` (null: the schedule's) in
  bin ``i`` instead of the schedule; ignore it when expired or when ``schedule_version`` is not
  the current schedule's version.
"""

from __future__ import annotations

from dataclasses import dataclass

BIN_LABEL = "bin"

ALPHA_HISTOGRAM = "sparrow_trainer_alpha"
ALPHA_BUCKETS: tuple[float, ...] = (
    0.5,
    0.6,
    0.7,
    0.75,
    0.8,
    0.83,
    0.86,
    0.88,
    0.9,
    0.92,
    0.94,
    0.96,
    0.98,
    0.99,
    0.995,
    0.999,
    1.0,
)
ALPHA_P5_GAUGE = "sparrow_trainer_alpha_p5"
ALPHA_TOKENS_GAUGE = "sparrow_trainer_alpha_tokens"
SCHEDULE_VERSION_GAUGE = "sparrow_trainer_schedule_version"
ALPHA_STEPS_COUNTER = "sparrow_trainer_alpha_steps"  # exposed with the _total suffix

PROBE_P5_GAUGE = "sparrow_trainer_alpha_probe_p5"
PROBE_TOKENS_GAUGE = "sparrow_trainer_alpha_probe_tokens"
PROBE_BUDGET_GAUGE = "sparrow_trainer_alpha_probe_budget_tokens"

ALPHA_P1_GAUGE = "sparrow_trainer_alpha_p1"
ALPHA_UNDER_HALF_GAUGE = "sparrow_trainer_alpha_under_half"

EXACT_ALPHA_HISTOGRAM = "sparrow_trainer_alpha_exact"
EXACT_P5_GAUGE = "sparrow_trainer_alpha_exact_p5"
EXACT_P1_GAUGE = "sparrow_trainer_alpha_exact_p1"
EXACT_UNDER_HALF_GAUGE = "sparrow_trainer_alpha_exact_under_half"
EXACT_TOKENS_GAUGE = "sparrow_trainer_alpha_exact_tokens"

# The quantile the stability statistic is defined on (DESIGN.md section 1): the default of the controller's
# `tail_quantile`. The quantiles with a gauge of their own per bin (the rest only through the histogram).
TAIL_QUANTILE = 0.05
GAUGE_QUANTILES: tuple[float, ...] = (0.05, 0.01)

ALPHA_SOURCES = ("topk", "exact")


@dataclass(frozen=True)
class AlphaSeries:
    """The Prometheus names of one kind of alpha (the top-k bound or the exact value)."""

    histogram: str
    tokens: str
    under_half: str
    quantile_gauges: dict[float, str]  # GAUGE_QUANTILES -> gauge name

    def gauge(self, q: float) -> str | None:
        """The per-bin gauge of quantile `q`, or None when only the histogram has it."""
        return next((name for gq, name in self.quantile_gauges.items() if abs(gq - q) < 1e-12), None)


def alpha_series(source: str) -> AlphaSeries:
    """The names of the `source` ("topk" or "exact") series."""
    if source == "topk":
        return AlphaSeries(ALPHA_HISTOGRAM, ALPHA_TOKENS_GAUGE, ALPHA_UNDER_HALF_GAUGE,
                           {0.05: ALPHA_P5_GAUGE, 0.01: ALPHA_P1_GAUGE})  # fmt: skip
    if source == "exact":
        return AlphaSeries(EXACT_ALPHA_HISTOGRAM, EXACT_TOKENS_GAUGE, EXACT_UNDER_HALF_GAUGE,
                           {0.05: EXACT_P5_GAUGE, 0.01: EXACT_P1_GAUGE})  # fmt: skip
    raise ValueError(f"alpha source must be one of {ALPHA_SOURCES}, got {source!r}")


# The generators' speculative decoding (`engine.decode = "speculative"`), per bin of the draft step's KV
# length; the lossless controller reads them. Counters are exposed with the _total suffix.
GENERATOR_SCHEDULE_VERSION_GAUGE = "sparrow_generator_schedule_version"
DRAFT_TOKENS_COUNTER = "sparrow_generator_draft_tokens"
ACCEPTED_DRAFT_TOKENS_COUNTER = "sparrow_generator_accepted_draft_tokens"
SPECULATIVE_CYCLES_COUNTER = "sparrow_generator_speculative_cycles"
DRAFT_ALPHA_HISTOGRAM = "sparrow_generator_draft_alpha"  # sum_x min(p, q) at each drafted position
# Timed cycles (decodes alone), per bin of their mean KV length: seconds of the k draft steps and of the rest of
# the cycle (the verify). The lossless controller solves the step overhead from their ratio (sparrow.cost).
DRAFT_SECONDS_COUNTER = "sparrow_generator_draft_seconds"
VERIFY_SECONDS_COUNTER = "sparrow_generator_verify_seconds"
TIMED_CYCLES_COUNTER = "sparrow_generator_timed_cycles"

SCHEDULE_KEY = "sparrow:schedule:current"
SCHEDULE_HISTORY_KEY = "sparrow:schedule:history"
SCHEDULE_UPDATES_CHANNEL = "sparrow:schedule:updates"
PROBE_KEY = "sparrow:schedule:probe"


def bin_label(index: int) -> str:
    """The value of the `bin` label for length bin `index` (its decimal index, "0", "1", ...)."""
    return str(index)


# Where each process's wall time goes (sparrow/timing.py): counters of seconds by phase, label ``phase``.
# The rates of one process's series add up to 1 (every second is charged to one phase, `other` included).
PHASE_LABEL = "phase"
TRAINER_PHASE_SECONDS = "sparrow_trainer_phase_seconds"  # exposed with the _total suffix
GENERATOR_PHASE_SECONDS = "sparrow_generator_phase_seconds"  # exposed with the _total suffix
# The trainer's phases of one RL step (docs/trainer.md says what each holds); the remainder is `other`.
TRAINER_PHASES = ("wait_groups", "reward", "score", "exact_alpha", "update", "distill", "publish", "checkpoint")
# The generator's: engine time by kind (a vLLM step is prefill or decode whole; sampling apart on the reference
# engine only), loading policies and adapters, and waiting with nothing to generate; the remainder is `other`.
GENERATOR_PHASES = ("prefill", "decode", "sampling", "weight_sync", "idle")
TIMING_PREFIX = "timing/"  # steps.jsonl, metrics.jsonl and the trackers: "timing/<phase>" in seconds
