"""The Grafana dashboards are well-formed, query only contract metrics, cover every one of them, and are
shipped identically by the provisioning (compose) and the chart's ConfigMap (Kubernetes).

Whether each query parses and returns data is checked against a live Prometheus in
tests/integration/deploy/test_dashboards_live.py.
"""

from __future__ import annotations

import json
import re

import yaml

from tests.unit.deploy.chart_render import CHART, REPO, find, objects
from tests.unit.deploy.metric_names import ALL_METRICS, series_names

DASHBOARDS = REPO / "deploy/grafana/dashboards"
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__range"}


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def exprs(board: dict) -> list[str]:
    return [t["expr"] for p in panels(board) for t in p["targets"]]


def test_dashboards_are_well_formed():
    boards = dashboards()
    assert len(boards) == 2
    assert len({b["uid"] for b in boards.values()}) == len(boards)
    for name, board in boards.items():
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        variables = {v["name"] for v in board["templating"]["list"]}
        assert "datasource" in variables
        for panel in panels(board):
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, f"{name}: {panel['title']}"
            assert panel["datasource"]["uid"] == "${datasource}", f"{name}: {panel['title']} has a fixed data source"
            assert panel["targets"], f"{name}: {panel['title']} has no query"
            for target in panel["targets"]:
                for var in re.findall(r"\$\{?(\w+)", target["expr"]):
                    assert var in variables | BUILTIN_VARIABLES, f"{name}: ${var} is not defined"


def test_queries_use_only_contract_metrics_and_cover_all_of_them():
    known = set().union(*(series_names(m) for m in ALL_METRICS))
    used = set()
    for name, board in dashboards().items():
        for expr in exprs(board):
            for metric in re.findall(r"\bsparrow_[a-z0-9_]+", expr):
                assert metric in known, f"{name}: {metric} is not a contract metric"
                used.add(metric)
    unused = [m for m in ALL_METRICS if not series_names(m) & used]
    assert not unused, f"no panel shows {unused}"


def test_the_issue_panels_exist():
    by_title = {p["title"]: p for board in dashboards().values() for p in panels(board)}

    def shown(metric: str, kind: str = "timeseries") -> bool:
        return any(kind == p["type"] and metric in json.dumps(p["targets"]) for p in by_title.values())

    assert shown("sparrow_trainer_alpha_p5") and any("vector($tau)" in t for t in map(json.dumps, by_title.values()))
    assert shown("sparrow_trainer_alpha_bucket", "heatmap")
    assert shown("sparrow_controller_budget_tokens")
    speedup = by_title["Predicted vs measured speedup"]["targets"]
    assert "sparrow_controller_predicted_speedup" in speedup[0]["expr"]
    assert "sparrow_generator_attended_kv_tokens_total" in speedup[1]["expr"]
    assert "by (instance)" in by_title["Rollout tokens/s per generator"]["targets"][0]["expr"]
    assert shown("sparrow_generator_queue_lag_entries")
    assert shown("sparrow_trainer_policy_version") and shown("sparrow_generator_schedule_version")
    assert shown("sparrow_trainer_reward_mean") and shown("sparrow_trainer_response_length_tokens")
    # Where the time goes: each process's seconds by phase, as a share of the whole, stacked.
    trainer_split = "Trainer time by phase (share of wall time, stacked)"
    generator_split = "Generator time by phase (share of loop time, all generators, stacked)"
    splits = {trainer_split: "sparrow_trainer_phase_seconds_total", generator_split: "sparrow_generator_phase_seconds"}
    for title, metric in splits.items():
        split = by_title[title]
        (target,) = split["targets"]
        assert target["expr"].startswith(f"sum by (phase) (rate({metric}") and " / ignoring (phase) " in target["expr"]
        assert target["legendFormat"] == "{{phase}}" and split["fieldConfig"]["defaults"]["unit"] == "percentunit"
        assert split["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    # Evaluation per mode (dense, under the schedule), and the accuracy the schedule costs: dense minus scheduled.
    evaluation = by_title["Held-out evaluation (avg@k, pass@k per source and mode)"]["targets"]
    assert all("mode)" in t["expr"] and "{{mode}}" in t["legendFormat"] for t in evaluation)
    gap = by_title["Held-out accuracy lost to the schedule (dense minus scheduled)"]["targets"]
    for target, metric in zip(gap, ("sparrow_trainer_eval_avg_reward", "sparrow_trainer_eval_pass_ratio"), strict=True):
        dense, scheduled = target["expr"].split(" - ")
        assert f'{metric}{{mode="dense"}}' in dense and f'{metric}{{mode="schedule"}}' in scheduled


def test_provisioning_matches_compose():
    datasource = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasource["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/sparrow.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{path}:ro" in mounts
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts


def test_chart_ships_the_same_dashboards():
    copies = {p.name: p.read_text() for p in sorted((CHART / "dashboards").glob("*.json"))}
    originals = {p.name: p.read_text() for p in sorted(DASHBOARDS.glob("*.json"))}
    assert copies == originals, "copy deploy/grafana/dashboards/*.json into helm/sparrow/dashboards/"
    maps = find(objects({"monitoring": {"dashboards": {"enabled": True}}}), "ConfigMap")
    (config_map,) = [m for m in maps if m["metadata"]["name"].endswith("-dashboards")]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert {k: json.loads(v) for k, v in config_map["data"].items()} == {k: json.loads(v) for k, v in originals.items()}


def test_chart_dashboards_follow_the_release_tau():
    # The controller and the alerts use the release's tau; the dashboards' tau line, "bins below tau"
    # and the p5 panel's threshold must too, or they contradict the alerts.
    maps = find(objects({"tau": 0.9, "monitoring": {"dashboards": {"enabled": True}}}), "ConfigMap")
    (config_map,) = [m for m in maps if m["metadata"]["name"].endswith("-dashboards")]
    got = {k: json.loads(v) for k, v in config_map["data"].items()}
    want = dashboards()
    board = want["sparrow-acceptance.json"]
    (tau,) = [v for v in board["templating"]["list"] if v["name"] == "tau"]
    default = float(tau["query"])
    tau.update(query="0.9", current={"text": "0.9", "value": "0.9"})
    moved = 0
    for panel in panels(board):
        for step in panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", []):
            if step["value"] == default:
                step["value"], moved = 0.9, moved + 1
    assert moved >= 1
    assert got == want
