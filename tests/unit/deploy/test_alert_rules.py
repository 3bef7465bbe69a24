"""The alert rules load in Prometheus' own checker, each alert has promtool unit tests that fire and stay
quiet, and the chart's PrometheusRule carries the same rules (at its defaults) or the release's values."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.deploy.chart_render import REPO, find, objects
from tests.unit.deploy.metric_names import ALL_METRICS, series_names

RULES = REPO / "deploy/prometheus/rules/sparrow.rules.yml"
PROMTOOL_TESTS = REPO / "tests/unit/deploy/promtool/sparrow_rules_test.yml"
ALERTS = {
    "SparrowTailAcceptanceBelowTau",
    "SparrowControllerBlind",
    "SparrowGeneratorsDown",
    "SparrowGeneratorTargetDown",
    "SparrowTrainerDown",
    "SparrowTrainerStalled",
    "SparrowQueueBacklog",
}


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool (Debian package prometheus) is missing: scripts/setup.sh installs it", pytrace=False)
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def rules_of(doc: dict) -> list[dict]:
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_rules_load_in_promtool():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout


def test_every_alert_fires_and_stays_quiet_in_promtool_unit_tests():
    done = promtool("test", "rules", str(PROMTOOL_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {r["alert"] for r in rules_of(yaml.safe_load(RULES.read_text()))} == ALERTS
    cases = yaml.safe_load(PROMTOOL_TESTS.read_text())["tests"]
    checks = [c for case in cases for c in case["alert_rule_test"]]
    for alert in ALERTS:
        assert any(c["alertname"] == alert and c["exp_alerts"] for c in checks), f"{alert} is never seen firing"
        assert any(c["alertname"] == alert and not c["exp_alerts"] for c in checks), f"{alert} is never seen quiet"


def test_promtool_unit_tests_can_fail(tmp_path):
    # With tau moved to 0.5 the tail alert no longer fires at p5 = 0.80: promtool must say so.
    moved = tmp_path / "deploy/prometheus/rules/sparrow.rules.yml"
    moved.parent.mkdir(parents=True)
    moved.write_text(RULES.read_text().replace("< 0.86", "< 0.5"))
    tests = tmp_path / "tests/unit/deploy/promtool/sparrow_rules_test.yml"
    tests.parent.mkdir(parents=True)
    tests.write_text(PROMTOOL_TESTS.read_text())
    done = promtool("test", "rules", str(tests))
    assert done.returncode != 0
    assert "SparrowTailAcceptanceBelowTau" in done.stdout + done.stderr


def test_rules_use_only_contract_metrics():
    known = set().union(*(series_names(m) for m in ALL_METRICS)) | {"up"}
    for rule in rules_of(yaml.safe_load(RULES.read_text())):
        for name in re.findall(r"\bsparrow_[a-z0-9_]+", rule["expr"]):
            assert name in known, f"{rule['alert']}: {name} is not a contract metric"


def test_chart_rules_equal_the_deploy_rules_at_defaults():
    (rule,) = find(objects({"monitoring": {"prometheusRule": {"enabled": True}}}), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_chart_rules_follow_the_release_values(tmp_path):
    values = {
        "tau": 0.9,
        "monitoring": {
            "prometheusRule": {
                "enabled": True,
                "tailBelowTauFor": "3m",
                "trainerStalledSeconds": 600,
                "queueLagEntries": 7,
            }
        },
    }
    (rule,) = find(objects(values), "PrometheusRule")
    by_name = {r["alert"]: r for r in rules_of(rule["spec"])}
    tail = by_name["SparrowTailAcceptanceBelowTau"]
    assert tail["expr"] == "min by (bin) (sparrow_trainer_alpha_p5) < 0.9" and tail["for"] == "3m"
    assert "below tau 0.9" in tail["annotations"]["summary"]
    stalled = by_name["SparrowTrainerStalled"]["expr"]
    assert "> 0) > 600" in stalled and "offset 600s) + 600 == 600" in stalled and "1800" not in stalled
    assert "> 7" in by_name["SparrowQueueBacklog"]["expr"]
    rendered = tmp_path / "rendered.rules.yml"
    rendered.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    done = promtool("check", "rules", str(rendered))
    assert done.returncode == 0, done.stdout + done.stderr


def test_prometheus_config_loads_the_rules():
    done = promtool("check", "config", str(REPO / "deploy/prometheus/prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout
    jobs = {
        j["job_name"] for j in yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"]
    }
    assert {"generator", "trainer", "controller"} <= jobs  # the job names the rules select on


def test_promtool_test_file_points_at_the_shipped_rules():
    doc = yaml.safe_load(PROMTOOL_TESTS.read_text())
    assert [(PROMTOOL_TESTS.parent / p).resolve() for p in doc["rule_files"]] == [Path(RULES).resolve()]
