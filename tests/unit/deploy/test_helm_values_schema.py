"""values.schema.json (and the chart's own checks) refuse bad values with a message naming the value."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.unit.deploy.chart_render import CHART, render

# (values, words the message must contain)
SCHEMA_CASES = [
    ({"generator": {"replicas": -1}}, ["/generator/replicas", "minimum"]),
    ({"tau": 1.2}, ["/tau", "exclusiveMaximum"]),
    ({"tau": 0}, ["/tau", "exclusiveMinimum"]),
    ({"tau": "high"}, ["/tau", "number"]),
    ({"generator": {"replica": 3}}, ["/generator", "replica"]),
    ({"trainer": {"grpcPort": 70000}}, ["/trainer/grpcPort", "maximum"]),
    ({"generator": {"gpu": {"count": -1}}}, ["/generator/gpu/count", "minimum"]),
    ({"generator": {"image": {"pullPolicy": "Sometimes"}}}, ["/generator/image/pullPolicy"]),
    (
        {"monitoring": {"prometheusRule": {"tailBelowTauFor": "10 minutes"}}},
        ["/monitoring/prometheusRule/tailBelowTauFor"],
    ),
    ({"trainer": {"persistence": {"size": "lots"}}}, ["/trainer/persistence/size"]),
    ({"controller": {"prometheusUrl": "prometheus:9090"}}, ["/controller/prometheusUrl"]),
    ({"generator": {"autoscaling": {"hpa": {"maxReplicas": 0}}}}, ["/generator/autoscaling/hpa/maxReplicas"]),
    ({"redis": {"external": {"database": 16}}}, ["/redis/external/database"]),
    ({"trainer": {"procs": -1}}, ["/trainer/procs", "minimum"]),
    ({"trainer": {"restarts": "often"}}, ["/trainer/restarts", "integer"]),
    ({"trainer": {"nodes": 0}}, ["/trainer/nodes", "minimum"]),
    ({"trainer": {"rendezvousPort": 0}}, ["/trainer/rendezvousPort", "minimum"]),
]

# Combinations a schema cannot express, refused by the templates with a one-line reason.
TEMPLATE_CASES = [
    (
        {"generator": {"autoscaling": {"hpa": {"enabled": True}, "keda": {"enabled": True}}}},
        "enable hpa or keda, not both",
    ),
    (
        {"generator": {"autoscaling": {"hpa": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}}},
        "minReplicas 5 is above maxReplicas 2",
    ),
    (
        {"generator": {"autoscaling": {"keda": {"enabled": True, "minReplicas": 4, "maxReplicas": 3}}}},
        "minReplicas 4 is above maxReplicas 3",
    ),
    ({"redis": {"enabled": False}}, "redis.external.host is required"),
    ({"trainer": {"procs": 2, "gpu": {"count": 4}}}, "trainer.procs 2 does not match trainer.gpu.count 4"),
    # Several trainer nodes write one run directory: a ReadWriteOnce volume or an emptyDir cannot be it.
    ({"trainer": {"nodes": 2}}, "trainer.nodes 2 needs a run directory every node mounts"),
    ({"trainer": {"nodes": 2, "persistence": {"enabled": False}}}, "trainer.nodes 2 needs a run directory every node"),
    (
        {"trainer": {"nodes": 2, "procs": 2, "persistence": {"accessModes": ["ReadWriteMany"]}}},
        "trainer.procs 2 does not match trainer.gpu.count 1",
    ),
    (
        {"monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
        "enable serviceMonitor or podMonitor, not both",
    ),
    ({"security": {"tls": {"enabled": True}}}, "security.tls.cert (PEM) is required"),
    # The controller refuses tau + margin >= 1 (its target): the schema's tau < 1 is not enough.
    ({"tau": 0.98}, "tau 0.98 + the controller's retune.margin 0.02 must be below 1"),
    (
        {"tau": 0.95, "controller": {"config": {"retune": {"margin": 0.05}}}},
        "tau 0.95 + the controller's retune.margin 0.05 must be below 1",
    ),
]


def test_defaults_pass_the_schema():
    with helm.Chart.load(CHART) as chart:
        assert chart.schema is not None
        chart.validate_schema(chart.values)


@pytest.mark.parametrize("values,words", SCHEMA_CASES, ids=[str(v) for v, _ in SCHEMA_CASES])
def test_schema_rejects_bad_values(values, words):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as refused:
            chart.validate_schema(chart.merge_values(values))
    for word in words:
        assert word in str(refused.value), str(refused.value)
    # Rendering (what `helm install` does) refuses them the same way.
    with pytest.raises(helm.HelmError):
        render(values)


@pytest.mark.parametrize("values,message", TEMPLATE_CASES, ids=[m for _, m in TEMPLATE_CASES])
def test_templates_refuse_impossible_combinations(values, message):
    with pytest.raises(helm.HelmRenderError) as refused:
        render(values)
    assert message in str(refused.value)


def test_a_tau_the_chart_takes_is_one_the_controller_takes(monkeypatch):
    from services.controller.config import ControllerConfig, RetuneConfig
    from sparrow.config import load_config

    # The chart assumes the controller's default margin when controller.config sets none.
    assert RetuneConfig.model_fields["margin"].default == 0.02
    for tau in (0.97, 0.86):
        render({"tau": tau})
        monkeypatch.setenv("SPARROW_RETUNE__TAU", str(tau))
        assert load_config(ControllerConfig).retune.tau == tau
