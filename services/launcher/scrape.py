"""Reading the running services: generators' /metrics, the schedule in Redis, PromQL from Prometheus.

Every reader returns None (or an empty dict) when its service does not answer: a generator killed
mid-run, or Prometheus still starting, must not stop the launcher.
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from sparrow import metrics_contract as mc

P5_PROMQL = "histogram_quantile(0.05, sum by (le, bin) (rate(" + mc.ALPHA_HISTOGRAM + "_bucket[{window}])))"


@dataclass(frozen=True)
class GeneratorSample:
    """One scrape of a generator's counters and gauges."""

    tokens_sparse: float = 0.0
    tokens_dense: float = 0.0
    busy_s: float = 0.0  # engine step time, summed
    steps: float = 0.0  # engine steps
    attended_kv: float = 0.0
    context_kv: float = 0.0
    policy_version: int = 0
    adapter_version: int = 0
    schedule_version: int = 0
    in_flight: int = 0
    budgets: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # seconds of the generator's loop by phase, summed

    @property
    def tokens(self) -> float:
        return self.tokens_sparse + self.tokens_dense


def parse_generator_metrics(text: str) -> GeneratorSample:
    """The figures the launcher follows, from a generator's exposition text."""
    values: dict[str, float] = {}
    attended = context = 0.0
    budgets: dict[str, float] = {}
    phases: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == mc.GENERATOR_PHASE_SECONDS + "_total":
                phases[s.labels.get(mc.PHASE_LABEL, "")] = s.value
            elif s.name == "sparrow_generator_tokens_total":
                values[f"tokens_{s.labels.get('mode', '')}"] = s.value
            elif s.name == "sparrow_generator_attended_kv_tokens_total":
                attended += s.value
            elif s.name == "sparrow_generator_context_kv_tokens_total":
                context += s.value
            elif s.name == "sparrow_generator_kv_budget_tokens":
                budgets[s.labels.get(mc.BIN_LABEL, "")] = s.value
            elif s.name in (
                "sparrow_generator_step_seconds_sum",
                "sparrow_generator_step_seconds_count",
                "sparrow_generator_policy_version",
                "sparrow_generator_adapter_version",
                "sparrow_generator_schedule_version",
                "sparrow_generator_in_flight_sequences",
            ):
                values[s.name] = s.value
    return GeneratorSample(
        tokens_sparse=values.get("tokens_sparse", 0.0),
        tokens_dense=values.get("tokens_dense", 0.0),
        busy_s=values.get("sparrow_generator_step_seconds_sum", 0.0),
        steps=values.get("sparrow_generator_step_seconds_count", 0.0),
        attended_kv=attended,
        context_kv=context,
        policy_version=int(values.get("sparrow_generator_policy_version", 0)),
        adapter_version=int(values.get("sparrow_generator_adapter_version", 0)),
        schedule_version=int(values.get("sparrow_generator_schedule_version", 0)),
        in_flight=int(values.get("sparrow_generator_in_flight_sequences", 0)),
        budgets=budgets,
        phases=phases,
    )


def scrape_generator(url: str, timeout_s: float = 2.0) -> GeneratorSample | None:
    """One generator's /metrics, or None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return parse_generator_metrics(resp.read().decode())
    except (OSError, ValueError):
        return None


def promql_by_bin(prometheus_url: str, query: str, timeout_s: float = 3.0) -> dict[str, float]:
    """An instant query's finite values by `bin` label; empty when Prometheus does not answer."""
    q = urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(f"{prometheus_url}/api/v1/query?{q}", timeout=timeout_s) as resp:
            result = json.load(resp)["data"]["result"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    out = {}
    for r in result:
        try:
            value = float(r["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if math.isfinite(value):
            out[r.get("metric", {}).get(mc.BIN_LABEL, "")] = value
    return out


def controller_speedup(prometheus_url: str) -> float | None:
    """The controller's current predicted speedup (its `sparrow_controller_predicted_speedup` gauge, through
    Prometheus), or None when it has none (a lossless controller before its first acceptance reading) or
    Prometheus does not answer."""
    return promql_by_bin(prometheus_url, "max(sparrow_controller_predicted_speedup)").get("")


def promql_p5(prometheus_url: str, window_s: float) -> dict[str, float]:
    """The controller's view of the tail: PromQL's histogram p5 per bin over the last `window_s`."""
    return promql_by_bin(prometheus_url, P5_PROMQL.format(window=f"{max(1, round(window_s))}s"))


def read_schedule(redis_client) -> tuple[dict | None, float | None]:
    """(the schedule JSON in Redis, the predicted speedup its publisher recorded), each None when absent."""
    import redis

    try:
        raw = redis_client.get(mc.SCHEDULE_KEY)
        last = redis_client.lindex(mc.SCHEDULE_HISTORY_KEY, -1)
    except (redis.RedisError, OSError):
        return None, None
    schedule = speedup = None
    try:
        schedule = json.loads(raw) if raw else None
        entry = json.loads(last) if last else None
        if isinstance(entry, dict) and isinstance(schedule, dict) and entry.get("version") == schedule.get("version"):
            value = entry.get("predicted_speedup")
            # NaN: the publisher had no prediction (a lossless controller before its first acceptance reading)
            speedup = float(value) if isinstance(value, int | float) and math.isfinite(value) else None
    except ValueError:
        pass
    return (schedule if isinstance(schedule, dict) else None), speedup
