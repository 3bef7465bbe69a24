"""The chart's code sandbox: off by default, least privilege that bubblewrap works with, scaled on its queue,
reachable from the trainer alone, no egress, and wired into the trainer's environment."""

from __future__ import annotations

from services.sandbox.config import SandboxConfig
from sparrow.config import load_config
from tests.unit.deploy.chart_render import ALL_ON_HPA, RELEASE, container, find, objects


def test_the_sandbox_renders_only_when_enabled():
    assert not [o for o in objects() if o["metadata"]["labels"].get("app.kubernetes.io/component") == "sandbox"]
    names = {e["name"] for e in container(objects(), "trainer")["env"]}
    assert "CODE_SANDBOX_URL" not in names


def test_the_pod_runs_unprivileged_with_only_the_profiles_bubblewrap_needs_relaxed():
    objs = objects(ALL_ON_HPA)
    (deployment,) = find(objs, "Deployment", "sandbox")
    pod = deployment["spec"]["template"]
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
    assert spec["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    assert pod["metadata"]["annotations"]["container.apparmor.security.beta.kubernetes.io/sandbox"] == "unconfined"
    c = container(objs, "sandbox")
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and "privileged" not in sc and "add" not in sc["capabilities"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["args"] == ["sandbox"]
    assert "replicas" not in deployment["spec"]  # left to the autoscaler


def test_the_autoscaler_follows_each_replicas_queue():
    (hpa,) = find(objects(ALL_ON_HPA), "HorizontalPodAutoscaler", "sandbox")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "sparrow_sandbox_queue_depth"
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-sparrow-sandbox"


def test_the_environment_is_the_services_config_and_the_trainer_is_pointed_at_it(monkeypatch):
    objs = objects(ALL_ON_HPA)
    env = {e["name"]: e for e in container(objs, "sandbox")["env"]}
    assert env["SPARROW_SECURITY__TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "service-token"
    for name, e in env.items():
        if "value" in e:
            monkeypatch.setenv(name, e["value"])
    config = load_config(SandboxConfig)  # every variable is a config key of the service, and valid
    assert (config.api.port, config.jail.proc, config.api.host) == (8490, False, "0.0.0.0")
    trainer = {e["name"]: e for e in container(objs, "trainer")["env"]}
    assert trainer["CODE_SANDBOX_URL"]["value"] == f"http://{RELEASE}-sparrow-sandbox:8490"
    assert trainer["CODE_SANDBOX_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "service-token"


def test_compose_runs_the_chart_s_sandbox_with_the_same_privileges():
    from tests.unit.deploy.test_compose_file import compose, container_ports
    from tests.unit.deploy.test_dockerfiles import base_images, image_env, stages

    service = compose()["services"]["sandbox"]
    chart = container(objects(ALL_ON_HPA), "sandbox")
    assert service["image"] == chart["image"] and service["command"] == chart["args"]
    assert container_ports(service) == {p["containerPort"] for p in chart["ports"]}
    chart_env = {e["name"]: e.get("value") for e in chart["env"]}
    assert set(service["environment"]) == set(chart_env)
    for key, value in chart_env.items():
        if value is not None:
            assert str(service["environment"][key]) == value, key
    assert service["environment"]["SPARROW_SECURITY__TOKEN"].startswith("${SPARROW_SERVICE_TOKEN:?")
    assert service["cap_drop"] == ["ALL"] and "no-new-privileges=true" in service["security_opt"]
    assert service["profiles"] == ["code"]
    # the image: pinned, multi-stage, non-root, health-checked, listening where it exposes
    assert len(base_images("sandbox")) == 2
    final = dict(stages("sandbox")[-1])
    assert final["USER"] == "10001:10001" and final["CMD"] == '["sandbox"]' and final["EXPOSE"] == "8490"
    assert '"sandbox"]' in final["HEALTHCHECK"]
    assert any(word == "RUN" and "install" in rest and "bubblewrap" in rest for word, rest in stages("sandbox")[-1])
    assert image_env("sandbox")["SPARROW_API__PORT"] == "8490" and image_env("sandbox")["SPARROW_JAIL__PROC"] == "false"
