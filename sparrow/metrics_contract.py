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

# The quantile the stability statistic is defined on (DESIGN.md section 1).
TAIL_QUANTILE = 0.05

SCHEDULE_KEY = "sparrow:schedule:current"
SCHEDULE_HISTORY_KEY = "sparrow:schedule:history"
SCHEDULE_UPDATES_CHANNEL = "sparrow:schedule:updates"
PROBE_KEY = "sparrow:schedule:probe"


def bin_label(index: int) -> str:
    """The value of the `bin` label for length bin `index` (its decimal index, "0", "1", ...)."""
    return str(index)
