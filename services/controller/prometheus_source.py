"""Reads the trainer's tail statistic per bin from a Prometheus server, over its HTTP API with PromQL.

The statistic is the configured quantile of alpha (`tail_quantile`, p5 by default; the readings keep
the name p5) of the configured series (`alpha`: the top-k bound or the exact value). "p5_exact" is
the trainer's gauge of that quantile over its last step (exact in the order-statistic sense), as
opposed to the histogram's estimate over a window.
"""

from __future__ import annotations

import asyncio
import math
import re

import httpx

from services.controller.readings import BinReading, DraftReading, Snapshot
from sparrow import metrics_contract as mc

# A bin label as the trainer writes it (`mc.bin_label`). Any other label value, which a foreign series may
# carry, names no bin: str.isdigit alone also takes '²', which int() refuses, and int() refuses 4,300 digits.
BIN_NUMBER = re.compile(r"[0-9]{1,9}")
# Queries whose values are p5s of alpha, a ratio: a value outside [0, 1] is no reading, whatever series gave it.
RATIO_QUERIES = ("p5_exact", "p5_histogram", "probe_p5")
# Queries whose values count tokens, which weigh readings: past 2^53 a count is no step's (and sums of such
# weights overflow a running mean to NaN).
TOKEN_QUERIES = ("tokens_exact", "tokens_window", "probe_tokens")
MAX_TOKENS = 2.0**53


class PrometheusUnavailable(RuntimeError):
    """Prometheus could not be asked or did not answer properly; the message says how."""


def queries(window_s: float, probes: bool, quantile: float = mc.TAIL_QUANTILE, alpha: str = "topk") -> dict[str, str]:
    """The PromQL the controller runs, by purpose; every per-bin query aggregates `by (bin)`.

    `quantile` is the tail statistic (0.05: p5) and `alpha` the series it is read from: the top-k
    bound or the exact value (`mc.alpha_series`). The gauge query reads the trainer's per-bin gauge
    of that quantile; a quantile without one (`mc.GAUGE_QUANTILES`) has only the histogram's.
    """
    names = mc.alpha_series(alpha)
    w = f"{max(1, round(window_s))}s"
    gauge = names.gauge(quantile)
    q = {
        "p5_histogram": (
            f"histogram_quantile({quantile:g}, sum by (le, {mc.BIN_LABEL}) (rate({names.histogram}_bucket[{w}])))"
        ),
        "tokens_exact": f"sum by ({mc.BIN_LABEL}) ({names.tokens})",
        "tokens_window": f"sum by ({mc.BIN_LABEL}) (increase({names.histogram}_count[{w}]))",
        # Seconds since each bin's newest sample; a target that stopped answering is stale.
        "age": f"time() - max by ({mc.BIN_LABEL}) (timestamp({names.tokens}))",
        "version": f"min({mc.SCHEDULE_VERSION_GAUGE})",
        "steps": f"max({mc.ALPHA_STEPS_COUNTER}_total)",
    }
    if gauge is not None:
        q["p5_exact"] = f"min by ({mc.BIN_LABEL}) ({gauge})"
    if probes:
        q["probe_p5"] = f"min by ({mc.BIN_LABEL}) ({mc.PROBE_P5_GAUGE})"
        q["probe_tokens"] = f"sum by ({mc.BIN_LABEL}) ({mc.PROBE_TOKENS_GAUGE})"
        q["probe_budget"] = f"max by ({mc.BIN_LABEL}) ({mc.PROBE_BUDGET_GAUGE})"
    return q


class PrometheusSource:
    """One `read()` per control tick: all queries at one evaluation time, readings per bin."""

    def __init__(
        self,
        url: str,
        window_s: float,
        timeout_s: float,
        max_age_s: float,
        probes: bool = False,
        quantile: float = mc.TAIL_QUANTILE,
        alpha: str = "topk",
    ) -> None:
        self.url = url.rstrip("/")
        self.window_s = window_s
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self.queries = queries(window_s, probes, quantile, alpha)
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()

    async def query(self, promql: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) per series; raises PrometheusUnavailable on any failure."""
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        try:
            # httpx's timeout bounds each socket read, not the answer: one trickling in would hold the tick.
            async with asyncio.timeout(self.timeout_s):
                resp = await self._client.get(f"{self.url}/api/v1/query", params=params)
        except httpx.HTTPError as exc:
            raise PrometheusUnavailable(f"cannot reach Prometheus at {self.url}: {exc!r}") from None
        except TimeoutError:
            raise PrometheusUnavailable(f"Prometheus did not answer {promql!r} within {self.timeout_s:g} s") from None
        try:
            body = resp.json()
        except ValueError:
            raise PrometheusUnavailable(f"Prometheus answered HTTP {resp.status_code} without JSON") from None
        if not isinstance(body, dict):  # a proxy or another service: JSON, but no API answer
            raise PrometheusUnavailable(f"Prometheus answered HTTP {resp.status_code} with JSON that is no API answer")
        if resp.status_code != 200 or body.get("status") != "success":
            raise PrometheusUnavailable(f"Prometheus rejected {promql!r}: {body.get('error', resp.status_code)}")
        data = body.get("data", {})
        kind = data.get("resultType") if isinstance(data, dict) else type(data).__name__
        if kind != "vector":
            raise PrometheusUnavailable(f"expected an instant vector for {promql!r}, got {kind}")
        try:
            series = [(item["metric"], float(item["value"][1])) for item in data.get("result", [])]
        except (KeyError, IndexError, TypeError, ValueError):
            series = None
        if series is None or not all(_is_label_set(labels) for labels, _ in series):
            raise PrometheusUnavailable(f"Prometheus answered {promql!r} with a malformed instant vector")
        return series

    async def read(self, now: float) -> Snapshot:
        """The trainer's readings per bin at time `now`; stale bins, NaN values and p5s outside [0, 1] are left out."""
        names = list(self.queries)
        results = await asyncio.gather(*(self.query(self.queries[n], at=now) for n in names))
        by_name = dict(zip(names, results, strict=True))
        per_bin: dict[str, dict[int, float]] = {name: _by_bin(series) for name, series in by_name.items()}
        for name in RATIO_QUERIES:
            if name in per_bin:
                per_bin[name] = {index: v for index, v in per_bin[name].items() if 0.0 <= v <= 1.0}
        for name in TOKEN_QUERIES:
            if name in per_bin:
                per_bin[name] = {index: v for index, v in per_bin[name].items() if 0.0 <= v <= MAX_TOKENS}
        version_series = by_name["version"]
        version = int(version_series[0][1]) if version_series and math.isfinite(version_series[0][1]) else None
        steps_series = by_name["steps"]
        steps = int(steps_series[0][1]) if steps_series and math.isfinite(steps_series[0][1]) else None
        bins: dict[int, BinReading] = {}
        for index, age in per_bin["age"].items():
            if age > self.max_age_s:
                continue
            probe_budget = per_bin.get("probe_budget", {}).get(index)
            bins[index] = BinReading(
                p5_exact=per_bin.get("p5_exact", {}).get(index),
                tokens_exact=per_bin["tokens_exact"].get(index, 0.0),
                p5_histogram=per_bin["p5_histogram"].get(index),
                tokens_window=per_bin["tokens_window"].get(index, 0.0),
                # Under one token (0: no probe) there is no budget to fit a curve at: log2 of it fails.
                probe_budget=int(probe_budget) if probe_budget is not None and probe_budget >= 1 else None,
                probe_p5=per_bin.get("probe_p5", {}).get(index),
                probe_tokens=per_bin.get("probe_tokens", {}).get(index, 0.0),
            )
        return Snapshot(trainer_version=version, bins=bins, trainer_steps=steps)


def draft_queries(window_s: float) -> dict[str, str]:
    """The PromQL of lossless mode: the generators' speculative counters per bin over the window W."""
    w = f"{max(1, round(window_s))}s"

    def increase(name: str) -> str:
        return f"sum by ({mc.BIN_LABEL}) (increase({name}[{w}]))"

    return {
        "alpha_sum": increase(f"{mc.DRAFT_ALPHA_HISTOGRAM}_sum"),
        "alpha_count": increase(f"{mc.DRAFT_ALPHA_HISTOGRAM}_count"),
        "drafts": increase(f"{mc.DRAFT_TOKENS_COUNTER}_total"),
        "accepted": increase(f"{mc.ACCEPTED_DRAFT_TOKENS_COUNTER}_total"),
        "cycles": increase(f"{mc.SPECULATIVE_CYCLES_COUNTER}_total"),
        "timed_cycles": increase(f"{mc.TIMED_CYCLES_COUNTER}_total"),
        "draft_seconds": increase(f"{mc.DRAFT_SECONDS_COUNTER}_total"),
        "verify_seconds": increase(f"{mc.VERIFY_SECONDS_COUNTER}_total"),
        "age": f"time() - max by ({mc.BIN_LABEL}) (timestamp({mc.DRAFT_TOKENS_COUNTER}_total))",
        "version": f"min({mc.GENERATOR_SCHEDULE_VERSION_GAUGE})",
    }


class DraftSource(PrometheusSource):
    """Lossless mode's `read()`: the generators' draft acceptance per bin over the window.

    A bin is left out when its counters are stale, when it drafted nothing in the window, or when its
    mean acceptance is not a ratio in [0, 1] (a foreign or broken series).
    """

    def __init__(self, url: str, window_s: float, timeout_s: float, max_age_s: float) -> None:
        super().__init__(url, window_s, timeout_s, max_age_s)
        self.queries = draft_queries(window_s)

    async def read(self, now: float) -> Snapshot:
        """The generators' readings per bin at time `now`, and the oldest schedule version they run."""
        names = list(self.queries)
        results = await asyncio.gather(*(self.query(self.queries[n], at=now) for n in names))
        by_name = dict(zip(names, results, strict=True))
        per_bin = {name: _by_bin(series) for name, series in by_name.items() if name != "version"}
        version_series = by_name["version"]
        version = int(version_series[0][1]) if version_series and math.isfinite(version_series[0][1]) else None
        bins: dict[int, DraftReading] = {}
        for index, age in per_bin["age"].items():
            count = per_bin["alpha_count"].get(index, 0.0)
            if age > self.max_age_s or not 0.0 < count <= MAX_TOKENS:
                continue
            alpha = per_bin["alpha_sum"].get(index, math.nan) / count
            if not 0.0 <= alpha <= 1.0 + 1e-9:
                continue
            counts = [per_bin[n].get(index, 0.0) for n in ("drafts", "accepted", "cycles")]
            drafts, accepted, cycles = (min(max(c, 0.0), MAX_TOKENS) for c in counts)
            timed = [per_bin[n].get(index, 0.0) for n in ("timed_cycles", "draft_seconds", "verify_seconds")]
            timed_cycles, draft_s, verify_s = (min(max(t, 0.0), MAX_TOKENS) for t in timed)
            bins[index] = DraftReading(min(alpha, 1.0), max(drafts, count), accepted, cycles, timed_cycles, draft_s,
                                       verify_s)  # fmt: skip
        return Snapshot(trainer_version=version, bins=bins)


def _is_label_set(labels: object) -> bool:
    return isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values())


def _by_bin(series: list[tuple[dict[str, str], float]]) -> dict[int, float]:
    """Values keyed by the integer `bin` label; NaN (no data) and unlabelled series are dropped."""
    out = {}
    for labels, value in series:
        label = labels.get(mc.BIN_LABEL)
        if label is None or not BIN_NUMBER.fullmatch(label) or not math.isfinite(value):
            continue
        out[int(label)] = value
    return out
