"""The trainer's tail metrics as the controller sees them: a real Prometheus scrapes the exporter,
and PromQL's histogram_quantile per bin lands within one bucket of the exact p5 gauge."""

import asyncio
import json
import threading
import time
import urllib.parse
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from services.controller.prometheus_source import PrometheusSource, queries
from services.trainer.tail_metrics import TailMetrics
from sparrow import metrics_contract as mc
from tests.servers import free_port, prometheus_server, wait_until


def _query(url: str, promql: str) -> dict[str, float]:
    q = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=5) as resp:
        data = json.load(resp)["data"]["result"]
    return {r["metric"].get("bin", ""): float(r["value"][1]) for r in data}


async def _controller_read(url: str, **kw):
    kw.setdefault("probes", True)
    source = PrometheusSource(url, window_s=10, timeout_s=5, max_age_s=60, **kw)
    try:
        return await source.read(time.time())
    finally:
        await source.aclose()


def _step(gen: torch.Generator, n: int = 4000) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's tokens in three bins whose tails differ: longer bins have worse tails."""
    kv = torch.randint(0, 6000, (n,), generator=gen)
    tail_weight = (kv // 2000 + 1).double() * 0.04  # bin 0: 4% of tokens in the tail, bin 2: 12%
    in_tail = torch.rand(n, generator=gen, dtype=torch.float64) < tail_weight
    alpha = torch.where(in_tail, torch.rand(n, generator=gen, dtype=torch.float64) * 0.8 + 0.1, 0.999)
    return alpha, kv


def _assert_near_bucket(estimate: float, value: float, what: str) -> None:
    """`estimate` lies in the histogram bucket holding `value`, widened by one bucket on each side."""
    edges = (0.0, *mc.ALPHA_BUCKETS)
    i = next(k for k in range(1, len(edges)) if value <= edges[k])
    low, high = edges[max(0, i - 2)], edges[min(len(edges) - 1, i + 1)]
    assert low <= estimate <= high, f"{what}: {estimate:.3f} vs {value:.3f}"


def test_exposition_follows_the_contract():
    metrics = TailMetrics(bin_width=2000)
    registry = CollectorRegistry()
    metrics.register(registry)
    metrics.record_step(torch.tensor([0.5, 0.86, 1.0, 0.99]), torch.tensor([10, 20, 2500, 2600]), 4)
    text = generate_latest(registry).decode()
    assert f'{mc.ALPHA_HISTOGRAM}_bucket{{bin="0",le="0.86"}} 2.0' in text  # le is inclusive
    assert f'{mc.ALPHA_HISTOGRAM}_bucket{{bin="1",le="+Inf"}} 2.0' in text
    assert f'{mc.ALPHA_TOKENS_GAUGE}{{bin="1"}} 2.0' in text
    assert f"{mc.SCHEDULE_VERSION_GAUGE} 4.0" in text
    assert f"{mc.ALPHA_STEPS_COUNTER}_total 1.0" in text
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        metrics.record_step(torch.tensor([1.5]), torch.tensor([3]), 4)
    # The same values again are a new step: only the counter tells them apart.
    metrics.record_step(torch.tensor([0.5, 0.86, 1.0, 0.99]), torch.tensor([10, 20, 2500, 2600]), 4)
    assert f"{mc.ALPHA_STEPS_COUNTER}_total 2.0" in generate_latest(registry).decode()
    assert mc.PROBE_P5_GAUGE not in generate_latest(registry).decode()  # no probe yet: no probe series


def _gauge(text: str, name: str) -> dict[str, float]:
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")}


def test_p1_share_under_half_and_the_exact_series_beside_the_bound():
    metrics = TailMetrics(bin_width=2000)
    registry = CollectorRegistry()
    metrics.register(registry)
    alpha = torch.linspace(0.0, 1.0, 101, dtype=torch.float64)  # 0.00, 0.01, ..., 1.00, all in bin 0
    kv = torch.full((101,), 10)
    metrics.record_step(alpha, kv, 3)
    text = generate_latest(registry).decode()
    assert _gauge(text, mc.ALPHA_P1_GAUGE)["0"] == pytest.approx(0.01)
    assert _gauge(text, mc.ALPHA_P5_GAUGE)["0"] == pytest.approx(0.05)
    assert _gauge(text, mc.ALPHA_UNDER_HALF_GAUGE)["0"] == pytest.approx(50 / 101)  # 0.00 .. 0.49
    assert mc.EXACT_ALPHA_HISTOGRAM + "_bucket" not in text  # no exact pass yet: no exact series
    # The exact pass: higher values, and one token it could not score (NaN) left out of the exact series only.
    exact = (alpha + 0.3).clamp(max=1.0)
    exact[7] = float("nan")
    metrics.record_step(alpha, kv, 3, exact=exact)
    text = generate_latest(registry).decode()
    assert _gauge(text, mc.EXACT_TOKENS_GAUGE)["0"] == 100 and _gauge(text, mc.ALPHA_TOKENS_GAUGE)["0"] == 101
    kept = torch.cat([exact[:7], exact[8:]])
    assert _gauge(text, mc.EXACT_P1_GAUGE)["0"] == pytest.approx(float(torch.quantile(kept, 0.01)))
    assert _gauge(text, mc.EXACT_P5_GAUGE)["0"] == pytest.approx(float(torch.quantile(kept, 0.05)))
    assert _gauge(text, mc.EXACT_UNDER_HALF_GAUGE)["0"] == pytest.approx(19 / 100)  # 0.30 .. 0.49, 0.37 left out
    assert f'{mc.EXACT_ALPHA_HISTOGRAM}_bucket{{bin="0",le="+Inf"}} 100.0' in text
    assert f'{mc.ALPHA_HISTOGRAM}_bucket{{bin="0",le="+Inf"}} 202.0' in text  # the bound counts both steps
    with pytest.raises(ValueError, match="exact alpha values"):
        metrics.record_step(alpha, kv, 3, exact=exact[:5])


def test_probe_tokens_export_their_own_p5_at_the_lowest_budget_per_bin():
    metrics = TailMetrics(bin_width=2000)
    registry = CollectorRegistry()
    metrics.register(registry)
    alpha = torch.tensor([1.0, 0.2, 0.9, 0.9, 0.5, 1.0], dtype=torch.float64)
    kv = torch.tensor([100, 200, 300, 2100, 2200, 2300])
    budgets = torch.tensor([0, 64, 64, 128, 256, 128])  # bin 0: one dense token; bin 1: 128 and 256
    metrics.record_probe(alpha, kv, budgets)
    text = generate_latest(registry).decode()
    assert f'{mc.PROBE_BUDGET_GAUGE}{{bin="0"}} 64.0' in text and f'{mc.PROBE_TOKENS_GAUGE}{{bin="0"}} 2.0' in text
    assert f'{mc.PROBE_BUDGET_GAUGE}{{bin="1"}} 128.0' in text and f'{mc.PROBE_TOKENS_GAUGE}{{bin="1"}} 2.0' in text
    p5 = {
        line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines() if line.startswith(mc.PROBE_P5_GAUGE)
    }
    assert p5["0"] == pytest.approx(0.2 + 0.05 * (0.9 - 0.2))  # the dense 1.0 left out
    assert p5["1"] == pytest.approx(0.9 + 0.05 * (1.0 - 0.9))  # the 0.5 at budget 256 left out
    assert mc.ALPHA_HISTOGRAM + "_bucket" not in text  # probe tokens never reach the schedule's statistic
    metrics.record_probe(torch.tensor([]), torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    text = generate_latest(registry).decode()  # a step without probe tokens: the readings go, not linger
    assert f'{mc.PROBE_P5_GAUGE}{{bin="0"}} NaN' in text and f'{mc.PROBE_TOKENS_GAUGE}{{bin="1"}} 0.0' in text
    with pytest.raises(ValueError, match="budgets"):
        metrics.record_probe(alpha, kv, budgets[:2])


def test_promql_p5_per_bin_matches_the_exact_gauge():
    metrics = TailMetrics(bin_width=2000)
    registry = CollectorRegistry()
    metrics.register(registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    gen = torch.Generator().manual_seed(0)
    stop = threading.Event()

    def trainer_steps():  # a step every 0.5 s until the queries are done, as a live trainer does
        while not stop.is_set():
            alpha, kv = _step(gen)
            metrics.record_step(alpha, kv, oldest_schedule_version=1)
            alpha, kv = _step(gen, 900)
            metrics.record_probe(alpha, kv, torch.full_like(kv, 96))
            stop.wait(0.5)

    feeder = threading.Thread(target=trainer_steps, daemon=True)
    try:
        with prometheus_server([f"127.0.0.1:{port}"]) as prom:
            feeder.start()
            time.sleep(12)  # a few scrape intervals of steps
            promql = f"histogram_quantile(0.05, sum by (le, bin) (rate({mc.ALPHA_HISTOGRAM}_bucket[10s])))"
            wait_until(lambda: len(_query(prom.url, promql)) == 3, 20, "a PromQL p5 for every bin", prom)
            estimated = _query(prom.url, promql)
            exact = _query(prom.url, f"{mc.ALPHA_P5_GAUGE}")
            # The controller's own reader sees the same bins and the trainer's step counter.
            snapshot = asyncio.run(_controller_read(prom.url))
    finally:
        stop.set()
        feeder.join(5)
        server.shutdown()
        server.server_close()
    for b, p5 in exact.items():
        _assert_near_bucket(estimated[b], p5, f"bin {b}: PromQL p5 vs exact")
    assert exact["2"] < exact["0"]  # the longer bin's tail is worse, and both views agree on it
    assert set(snapshot.bins) == {0, 1, 2} and snapshot.trainer_version == 1
    assert snapshot.trainer_steps is not None and snapshot.trainer_steps >= 5
    for reading in snapshot.bins.values():  # and the probe readings, with the budget they ran at
        assert reading.probe_budget == 96 and 0 <= reading.probe_p5 <= 1 and 200 < reading.probe_tokens < 400
    assert estimated["2"] < estimated["0"]


def test_the_controller_holds_p1_of_the_exact_series_and_promql_agrees_with_its_gauge():
    metrics = TailMetrics(bin_width=2000)
    registry = CollectorRegistry()
    metrics.register(registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    gen = torch.Generator().manual_seed(1)
    stop = threading.Event()

    def trainer_steps():
        while not stop.is_set():
            alpha, kv = _step(gen)
            # The exact value sits above the bound (the bound is loose in the tail).
            metrics.record_step(alpha, kv, oldest_schedule_version=2, exact=(alpha + 0.2).clamp(max=1.0))
            stop.wait(0.5)

    feeder = threading.Thread(target=trainer_steps, daemon=True)
    try:
        with prometheus_server([f"127.0.0.1:{port}"]) as prom:
            feeder.start()
            time.sleep(12)
            promql = queries(10, False, 0.01, "exact")["p5_histogram"]
            assert promql.startswith("histogram_quantile(0.01, ") and mc.EXACT_ALPHA_HISTOGRAM + "_bucket" in promql
            wait_until(lambda: len(_query(prom.url, promql)) == 3, 20, "a PromQL p1 for every bin", prom)
            estimated = _query(prom.url, promql)
            gauge = _query(prom.url, mc.EXACT_P1_GAUGE)
            bound_p1 = _query(prom.url, mc.ALPHA_P1_GAUGE)
            p1 = asyncio.run(_controller_read(prom.url, probes=False, quantile=0.01, alpha="exact"))
            p5 = asyncio.run(_controller_read(prom.url, probes=False, quantile=0.05, alpha="exact"))
    finally:
        stop.set()
        feeder.join(5)
        server.shutdown()
        server.server_close()
    for b, value in gauge.items():
        _assert_near_bucket(estimated[b], value, f"bin {b}: PromQL p1 vs gauge")
        assert value > bound_p1[b]  # the exact series is its own, not the bound's
    assert set(p1.bins) == {0, 1, 2}
    for b, reading in p1.bins.items():
        # The controller's gauge reading is one step's p1 (steps move on between the two reads): a low tail,
        # well under the same series' p5.
        assert reading.p5_exact is not None and reading.p5_exact < p5.bins[b].p5_exact
        assert reading.tokens_exact > 1000
