"""Rendering helm/sparrow with Helm's own library (the helm-python-sdk wheel's libhelm), for the deploy tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm/sparrow"
RELEASE = "demo"
NAMESPACE = "rl"

# Every optional feature on. HPA and KEDA exclude each other (KEDA runs its own HPA), and so do the
# ServiceMonitor and the PodMonitor (each would scrape every target), so "all on" is two value sets.
MONITORING_ON = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "prometheusRule": {"enabled": True},
    "dashboards": {"enabled": True},
}
MONITORING_ON_PODS = {**MONITORING_ON, "serviceMonitor": {"enabled": False}, "podMonitor": {"enabled": True}}
ALL_ON_HPA: dict[str, Any] = {
    "generator": {"autoscaling": {"hpa": {"enabled": True}}, "config": {"engine": {"gpu_memory_utilization": 0.85}}},
    "trainer": {"config": {"steps": 100}},
    "controller": {"config": {"interval_s": 15.0}},
    "sandbox": {"enabled": True, "autoscaling": {"hpa": {"enabled": True}}},
    "monitoring": MONITORING_ON,
    "networkPolicy": {"enabled": True, "controllerApiFrom": [{"namespaceSelector": {"matchLabels": {"team": "rl"}}}]},
    "security": {"tls": {"enabled": True, "cert": "CERT PEM", "key": "KEY PEM", "ca": "CA PEM"}},
    "imagePullSecrets": [{"name": "registry"}],
}
ALL_ON_KEDA: dict[str, Any] = {
    "generator": {"autoscaling": {"keda": {"enabled": True}}},
    "sandbox": {"enabled": True},
    "monitoring": MONITORING_ON_PODS,
    "networkPolicy": {"enabled": True},
    "security": {"tls": {"enabled": True, "existingSecret": "sparrow-tls"}, "existingSecret": "sparrow-tokens"},
}
EXTERNAL_REDIS: dict[str, Any] = {
    "redis": {"enabled": False, "external": {"host": "redis.shared.svc", "port": 6380, "database": 2}},
    "trainer": {"persistence": {"enabled": False}},
    "generator": {"autoscaling": {"keda": {"enabled": True}}},
    "networkPolicy": {"enabled": True},
}
# The trainer over 2 nodes of 4 GPUs: a JobSet on a shared (ReadWriteMany) run directory.
SEVERAL_NODES: dict[str, Any] = {
    "trainer": {"nodes": 2, "gpu": {"count": 4}, "restarts": 2, "persistence": {"accessModes": ["ReadWriteMany"]}},
    "monitoring": MONITORING_ON_PODS,
    "networkPolicy": {"enabled": True},
    "security": {"tls": {"enabled": True, "existingSecret": "sparrow-tls"}},
}
VARIANTS = {
    "defaults": None,
    "all-on-hpa": ALL_ON_HPA,
    "all-on-keda": ALL_ON_KEDA,
    "external-redis": EXTERNAL_REDIS,
    "several-nodes": SEVERAL_NODES,
}


def render(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included), as `helm template` would produce."""
    with helm.Chart.load(CHART) as chart:
        return chart.render(values=values, name=RELEASE, namespace=NAMESPACE)


def objects(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders with `values`."""
    out = []
    for path, text in sorted(render(values).items()):
        if path.endswith(".yaml"):
            out += [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def find(objs: list[dict[str, Any]], kind: str, component: str | None = None) -> list[dict[str, Any]]:
    """Objects of `kind` (and of `component`, by the app.kubernetes.io/component label)."""
    found = [o for o in objs if o["kind"] == kind]
    if component is not None:
        found = [o for o in found if o["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    return found


def pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a Deployment, StatefulSet or JobSet (its one replicated Job's)."""
    if workload["kind"] == "JobSet":
        (replicated,) = workload["spec"]["replicatedJobs"]
        return replicated["template"]["spec"]["template"]
    return workload["spec"]["template"]


def container(objs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    """The one container of the component's workload (Deployment, StatefulSet, or the several-node JobSet)."""
    kinds = ("Deployment", "StatefulSet", "JobSet")
    (workload,) = [o for kind in kinds for o in find(objs, kind, component)]
    (c,) = pod_template(workload)["spec"]["containers"]
    return c
