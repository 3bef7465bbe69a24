"""The trainer's export of tail acceptance per length bin, under the names of `sparrow.metrics_contract`.

Each RL step scores every generated token (alpha against the dense policy) and hands the step's
alpha values, with the KV length each token was produced at, to `TailMetrics.record_step`. The
histogram accumulates over the run so that PromQL's `histogram_quantile` over a `rate` window is
the p5 of recent steps; the gauges hold the exact p5, p1, share under 0.5 and token count of the
last step. The top-k bound always; with the exact pass (`[trainer] alpha = "exact"`) the exact
values too, as a second set of series (`mc.alpha_series`), so the gap shows per bin.

Bucket counts are added per step with one vectorised pass rather than one `observe` per token: a
step holds hundreds of thousands of tokens.

Tokens of probe sequences (run at the controller's probe budgets, not the schedule's) go to
`record_probe` instead: per bin, the exact p5 and token count of the last step's probe tokens at the
lowest budget they used in that bin, with that budget (`PROBE_*` gauges). They never enter the
histogram or the p5 gauge, which describe the schedule in force.
"""

from __future__ import annotations

import math
import threading

import torch
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from sparrow import metrics_contract as mc
from sparrow.acceptance import DEFAULT_QUANTILE, BinStats, bin_index, binned_stats, quantile
from sparrow.schedule import DEFAULT_BIN_WIDTH


class _Series:
    """One kind of alpha's per-bin histogram and last-step gauges (the top-k bound or the exact value)."""

    def __init__(self, names: mc.AlphaSeries, edges: torch.Tensor) -> None:
        self.names = names
        self._edges = edges
        self.buckets: dict[int, torch.Tensor] = {}  # bin -> cumulative count per bucket edge, +Inf last
        self.sums: dict[int, float] = {}
        self.last: dict[int, BinStats] = {}

    def record(self, alpha: torch.Tensor, bins: torch.Tensor, stats: list[BinStats]) -> None:
        for b in bins.unique().tolist():
            values = alpha[bins == b]
            # le semantics: a value equal to an edge counts in that bucket; edges are compared in the
            # values' own precision (a float32 0.86 is not above the edge 0.86).
            per_edge = torch.bucketize(values, self._edges.to(values.dtype), right=False)
            counts = torch.bincount(per_edge, minlength=len(self._edges) + 1).to(torch.float64)
            cumulative = counts.cumsum(0)
            self.buckets[b] = self.buckets.get(b, torch.zeros_like(cumulative)) + cumulative
            self.sums[b] = self.sums.get(b, 0.0) + float(values.double().sum())
        self.last = {s.index: s for s in stats}

    def families(self, what: str) -> list:
        n = self.names
        hist = HistogramMetricFamily(n.histogram, f"Per-token acceptance rate alpha ({what})", labels=[mc.BIN_LABEL])
        for b in sorted(self.buckets):
            cumulative = self.buckets[b].tolist()
            pairs = [(_le(edge), count) for edge, count in zip(mc.ALPHA_BUCKETS, cumulative, strict=False)]
            pairs.append(("+Inf", cumulative[-1]))
            hist.add_metric([str(b)], pairs, self.sums[b])
        p5 = GaugeMetricFamily(n.gauge(0.05), f"Exact p5 of alpha ({what}) over the last step", labels=[mc.BIN_LABEL])
        p1 = GaugeMetricFamily(n.gauge(0.01), f"Exact p1 of alpha ({what}) over the last step", labels=[mc.BIN_LABEL])
        under = GaugeMetricFamily(
            n.under_half, f"Share of the last step's tokens with alpha ({what}) < 0.5", labels=[mc.BIN_LABEL]
        )
        tokens = GaugeMetricFamily(n.tokens, f"Tokens behind the exact p5 ({what})", labels=[mc.BIN_LABEL])
        for b in sorted(self.buckets):
            s = self.last.get(b)
            p5.add_metric([str(b)], s.quantile if s else math.nan)
            p1.add_metric([str(b)], s.p1 if s else math.nan)
            under.add_metric([str(b)], s.under_half if s else math.nan)
            tokens.add_metric([str(b)], s.count if s else 0)
        return [hist, p5, p1, under, tokens]


class TailMetrics:
    """Collector of the alpha histograms, their last-step gauges per bin, and the schedule version."""

    def __init__(
        self, bin_width: int = DEFAULT_BIN_WIDTH, num_bins: int | None = None, quantile: float = DEFAULT_QUANTILE
    ) -> None:
        self.bin_width, self.num_bins, self.quantile = bin_width, num_bins, quantile
        edges = torch.tensor(mc.ALPHA_BUCKETS, dtype=torch.float64)
        self._topk = _Series(mc.alpha_series("topk"), edges)
        self._exact: _Series | None = None  # from the first step that ran the exact pass
        self._edges = edges
        self._schedule_version: float = math.nan
        self._steps = 0
        self._probe: dict[int, tuple[float, int, int]] = {}  # bin -> (exact quantile, tokens, budget), last step
        self._probe_bins: set[int] = set()  # every bin a probe reading was exported for
        self._lock = threading.Lock()

    def record_step(
        self,
        alpha: torch.Tensor,
        kv_lens: torch.Tensor,
        oldest_schedule_version: int,
        exact: torch.Tensor | None = None,
    ) -> None:
        """Add one step's tokens: alpha [n] in [0, 1] and the KV length [n] each token was produced at.

        `exact` [n]: the exact alpha of the same tokens, NaN where the exact pass had none (those
        tokens are left out of the exact series only).
        """
        alpha = _checked(alpha)
        kv = torch.as_tensor(kv_lens).reshape(-1)
        bins = bin_index(kv, self.bin_width, self.num_bins)
        stats = binned_stats(alpha, kv, self.bin_width, self.quantile, self.num_bins)
        if exact is not None:
            exact = torch.as_tensor(exact).reshape(-1)
            if exact.numel() != alpha.numel():
                raise ValueError(f"{exact.numel()} exact alpha values for {alpha.numel()} tokens")
            have = ~torch.isnan(exact)
            exact, exact_kv = _checked(exact[have]), kv[have]
            exact_bins = bin_index(exact_kv, self.bin_width, self.num_bins)
            exact_stats = binned_stats(exact, exact_kv, self.bin_width, self.quantile, self.num_bins)
        with self._lock:
            self._topk.record(alpha, bins, stats)
            if exact is not None:
                if self._exact is None:
                    self._exact = _Series(mc.alpha_series("exact"), self._edges)
                self._exact.record(exact, exact_bins, exact_stats)
            self._schedule_version = float(oldest_schedule_version)
            self._steps += 1

    def record_probe(self, alpha: torch.Tensor, kv_lens: torch.Tensor, budgets: torch.Tensor) -> None:
        """Set the probe gauges from one step's probe tokens: alpha [n], KV length [n], budget [n] (0 = dense).

        Dense tokens carry no probe information and are left out; in a bin where probe tokens ran at
        several budgets (a probe changed or ended mid-sequence), those at the lowest one count.
        Call it every step (with no tokens when there were none) so that old readings do not linger.
        """
        alpha = torch.as_tensor(alpha).reshape(-1).double()
        kv = torch.as_tensor(kv_lens).reshape(-1)
        budgets = torch.as_tensor(budgets).reshape(-1).long()
        if not alpha.numel() == kv.numel() == budgets.numel():
            raise ValueError(f"{alpha.numel()} alpha values, {kv.numel()} KV lengths, {budgets.numel()} budgets")
        if alpha.numel() and (bool(torch.isnan(alpha).any()) or float(alpha.min()) < 0 or float(alpha.max()) > 1):
            raise ValueError("alpha values must lie in [0, 1]")
        sparse = budgets > 0
        alpha, kv, budgets = alpha[sparse], kv[sparse], budgets[sparse]
        bins = bin_index(kv, self.bin_width, self.num_bins)
        readings = {}
        for b in bins.unique().tolist():
            in_bin = bins == b
            lowest = int(budgets[in_bin].min())
            values = alpha[in_bin & (budgets == lowest)]
            readings[b] = (quantile(values, self.quantile), int(values.numel()), lowest)
        with self._lock:
            self._probe = readings
            self._probe_bins |= set(readings)

    def collect(self):
        """Prometheus collector protocol: the metric families, read under the lock."""
        with self._lock:
            families = self._topk.families("top-k bound")
            if self._exact is not None:
                families += self._exact.families("exact")
            version = GaugeMetricFamily(mc.SCHEDULE_VERSION_GAUGE, "Oldest schedule version behind the last step")
            version.add_metric([], self._schedule_version)
            steps = CounterMetricFamily(mc.ALPHA_STEPS_COUNTER, "Steps whose tokens were recorded", value=self._steps)
            families += [version, steps]
            if self._probe_bins:
                probe_p5 = GaugeMetricFamily(
                    mc.PROBE_P5_GAUGE, "Exact p5 of alpha of the last step's probe tokens", labels=[mc.BIN_LABEL]
                )
                probe_tokens = GaugeMetricFamily(
                    mc.PROBE_TOKENS_GAUGE, "Probe tokens behind the probe p5", labels=[mc.BIN_LABEL]
                )
                probe_budget = GaugeMetricFamily(
                    mc.PROBE_BUDGET_GAUGE, "KV budget the probe tokens ran at", labels=[mc.BIN_LABEL]
                )
                for b in sorted(self._probe_bins):
                    q, n, budget = self._probe.get(b, (math.nan, 0, 0))
                    probe_p5.add_metric([str(b)], q)
                    probe_tokens.add_metric([str(b)], n)
                    probe_budget.add_metric([str(b)], budget)
                families += [probe_p5, probe_tokens, probe_budget]
        return families

    def register(self, registry: CollectorRegistry) -> TailMetrics:
        """Serve these metrics from `registry`."""
        registry.register(self)
        return self


def _le(edge: float) -> str:
    return repr(float(edge))


def _checked(alpha: torch.Tensor) -> torch.Tensor:
    alpha = torch.as_tensor(alpha).reshape(-1)
    if not alpha.is_floating_point():
        alpha = alpha.double()
    if alpha.numel() and (bool(torch.isnan(alpha).any()) or float(alpha.min()) < 0 or float(alpha.max()) > 1):
        raise ValueError("alpha values must lie in [0, 1]")
    return alpha
