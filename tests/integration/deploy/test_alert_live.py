"""The p5-below-tau alert fires in a real Prometheus when the trainer's p5 in one bin drops below tau.

A real Prometheus evaluates a copy of deploy/prometheus/rules/sparrow.rules.yml whose only change is
a short `for` on the tail alert, while scraping the trainer's own metrics class (TrainerMetrics with
its TailMetrics), fed 200 tokens per bin per step by the test. p5 starts above tau everywhere (no
alert), is driven below tau in bin 2 (the alert fires for bin 2 only), then recovers (it resolves).
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests.integration.deploy.service_exporters import running_cluster
from tests.servers import prometheus_server, wait_until

REPO = Path(__file__).resolve().parents[3]
RULES = REPO / "deploy/prometheus/rules/sparrow.rules.yml"
ALERT = "SparrowTailAcceptanceBelowTau"


def rules_with_short_for(tmp_path: Path, alert: str, for_: str) -> Path:
    """A copy of the shipped rules with `alert`'s `for` replaced; everything else unchanged."""
    doc = yaml.safe_load(RULES.read_text())
    found = [rule for group in doc["groups"] for rule in group["rules"] if rule.get("alert") == alert]
    assert len(found) == 1, f"{alert} not in {RULES}"
    found[0]["for"] = for_
    path = tmp_path / "sparrow.rules.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def tail_alerts(url: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/alerts", timeout=5) as resp:
        alerts = json.loads(resp.read())["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == ALERT]


def last_evaluation(url: str) -> float:
    """Unix time of the tail rule's last evaluation."""
    with urllib.request.urlopen(f"{url}/api/v1/rules?type=alert", timeout=5) as resp:
        groups = json.loads(resp.read())["data"]["groups"]
    rule = next(r for g in groups for r in g["rules"] if r["name"] == ALERT)
    assert rule["health"] == "ok", rule
    # RFC 3339 with up to nanoseconds; datetime takes microseconds.
    stamp = re.sub(r"(\.\d{6})\d*", r"\1", rule["lastEvaluation"]).replace("Z", "+00:00")
    return datetime.fromisoformat(stamp).timestamp()


def evaluated_with_all_bins(url: str) -> bool:
    """Every bin's p5 has been scraped."""
    query = urllib.parse.quote("count(sparrow_trainer_alpha_p5)")
    with urllib.request.urlopen(f"{url}/api/v1/query?query={query}", timeout=5) as resp:
        result = json.loads(resp.read())["data"]["result"]
    return bool(result) and float(result[0]["value"][1]) == 4


@pytest.mark.slow
def test_p5_below_tau_fires_for_that_bin_and_resolves(tmp_path):
    rules = rules_with_short_for(tmp_path, ALERT, "2s")
    with running_cluster(p5={}, generators=1) as cluster:
        with prometheus_server(cluster.scrape_targets, rule_files=[rules]) as prom:
            wait_until(lambda: evaluated_with_all_bins(prom.url), 30, "p5 of every bin scraped", prom)
            # Every bin holds p5 = 0.97: once the rule has been evaluated on that data, nothing is pending.
            since = time.time()
            wait_until(lambda: last_evaluation(prom.url) > since + 1, 30, "tail rule evaluated", prom)
            assert tail_alerts(prom.url) == []

            cluster.trainer.p5["2"] = 0.5
            wait_until(lambda: [a["state"] for a in tail_alerts(prom.url)] == ["firing"], 30, "tail alert firing", prom)
            (alert,) = tail_alerts(prom.url)
            assert alert["labels"] == {"alertname": ALERT, "bin": "2", "severity": "critical"}
            assert float(alert["value"]) == pytest.approx(0.5, abs=0.01)
            assert "below tau 0.86" in alert["annotations"]["summary"]

            cluster.trainer.p5["2"] = 0.97
            wait_until(lambda: tail_alerts(prom.url) == [], 30, "tail alert resolved", prom)
