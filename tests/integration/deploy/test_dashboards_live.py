"""Every Grafana panel's PromQL runs against a live Prometheus and returns data.

By default a real Prometheus scrapes the exporters of `service_exporters.py`: the trainer's,
generators' and controller's own metrics classes, fed made-up values by the test. Set
SPARROW_LIVE_PROMETHEUS_URL to a Prometheus that scrapes a running cluster (an end-to-end run) to
check the same queries against the real services instead.

Dashboard variables are substituted as Grafana would: `$bin` by its "All" value `.*` and by one
concrete bin, `$tau` by its constant, `$__rate_interval` by a window that holds several scrapes.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.deploy.service_exporters import running_cluster
from tests.servers import prometheus_server
from tests.unit.deploy.metric_names import ALL_METRICS, series_names

REPO = Path(__file__).resolve().parents[3]
DASHBOARDS = sorted((REPO / "deploy/grafana/dashboards").glob("*.json"))
LIVE_URL = os.environ.get("SPARROW_LIVE_PROMETHEUS_URL", "")
QUERY_TIMEOUT_S = 45.0


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every target of every panel."""
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets") or []:
                out.append((path.name, panel["title"], target["expr"]))
    return out


def substitute(expr: str, bin_value: str, rate_interval: str) -> str:
    """The query Grafana sends for `expr` with these variable values."""
    for name, value in (("$__rate_interval", rate_interval), ("$bin", bin_value), ("$tau", "0.86")):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def instant_query(base_url: str, expr: str) -> dict:
    """The JSON answer of /api/v1/query; raises on an HTTP error (a PromQL parse error is a 400)."""
    url = f"{base_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def finite_values(answer: dict) -> list[float]:
    """The finite sample values of a vector or scalar answer."""
    data = answer["data"]
    if data["resultType"] == "scalar":
        values = [float(data["result"][1])]
    else:
        values = [float(sample["value"][1]) for sample in data["result"]]
    return [v for v in values if math.isfinite(v)]


@contextmanager
def prometheus_with_data() -> Iterator[tuple[str, str]]:
    """(Prometheus URL, a bin with data): the live one when configured, else a real one on the fed exporters."""
    if LIVE_URL:
        yield LIVE_URL.rstrip("/"), os.environ.get("SPARROW_LIVE_BIN", "0")
        return
    with running_cluster() as cluster, prometheus_server(cluster.scrape_targets) as prom:
        yield prom.url, "2"


def test_dashboards_exist_and_have_queries():
    assert [p.name for p in DASHBOARDS] == ["sparrow-acceptance.json", "sparrow-cluster.json"]
    assert len(panel_queries()) > 40


@pytest.mark.slow
def test_every_panel_query_returns_data_from_live_prometheus():
    rate_interval = os.environ.get("SPARROW_LIVE_RATE_INTERVAL", "1m" if LIVE_URL else "6s")
    with prometheus_with_data() as (url, one_bin):
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        failures = []
        for dashboard, title, expr in panel_queries():
            for bin_value in (".*", one_bin):
                query = substitute(expr, bin_value, rate_interval)
                # Rates need a few scrapes: poll until the query has data or the shared deadline passes.
                while True:
                    answer = instant_query(url, query)
                    assert answer["status"] == "success", f"{dashboard} / {title}: {query}: {answer}"
                    if finite_values(answer) or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                if not finite_values(answer):
                    failures.append(f"{dashboard} / {title}: {query} returned {answer['data']['result']}")
        assert not failures, "panels without data:\n" + "\n".join(failures)


def test_a_malformed_query_is_refused_by_prometheus():
    # The check above relies on Prometheus refusing what does not parse; make sure it does here.
    with running_cluster(generators=1) as cluster, prometheus_server(cluster.scrape_targets) as prom:
        with pytest.raises(urllib.error.HTTPError) as refused:
            instant_query(prom.url, "sum by (bin (sparrow_trainer_alpha_p5)")
        assert refused.value.code == 400


def test_service_metrics_classes_export_exactly_the_contract_names():
    # The services' metrics classes export exactly the agreed names (what dashboards and rules query).
    served: set[str] = set()
    with running_cluster(generators=1) as cluster:
        for targets in cluster.scrape_targets.values():
            for target in targets:
                with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as resp:
                    text = resp.read().decode()
                served |= {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    served = {name for name in served if name.startswith("sparrow_")}
    expected = set().union(*(series_names(m) for m in ALL_METRICS))
    # prometheus_client adds a _created series to counters and histograms; Prometheus stores it too.
    assert {n for n in served if not n.endswith("_created")} == expected
