"""helm/sparrow renders with Helm's real library, lints clean, and every object is valid Kubernetes.

Built-in kinds are validated strictly (unknown fields refused) against the Kubernetes OpenAPI
schemas of `kubernetes-validate` for the oldest (1.29) and newest Kubernetes it ships; the Prometheus
Operator and KEDA kinds, whose CRD schemas are not on disk, against the fields their CRDs require.
"""

from __future__ import annotations

import copy

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest

from tests.unit.deploy.chart_render import (
    ALL_ON_HPA,
    ALL_ON_KEDA,
    CHART,
    EXTERNAL_REDIS,
    NAMESPACE,
    RELEASE,
    VARIANTS,
    container,
    find,
    objects,
    render,
)

K8S_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "helm.sh/chart")

_SELECTOR = {"type": "object", "minProperties": 1}
_META = {"type": "object", "required": ["name", "labels"]}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": _SELECTOR,
                    "jobLabel": {"type": "string"},
                    "namespaceSelector": {"type": "object"},
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {"type": "object", "required": ["port"], "properties": {"port": {"type": "string"}}},
                    },
                },
            },
        },
    },
    ("monitoring.coreos.com/v1", "PodMonitor"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["selector", "podMetricsEndpoints"],
                "properties": {
                    "selector": _SELECTOR,
                    "podMetricsEndpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {"type": "object", "required": ["port"], "properties": {"port": {"type": "string"}}},
                    },
                },
            },
        },
    },
    ("monitoring.coreos.com/v1", "PrometheusRule"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["groups"],
                "properties": {
                    "groups": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["name", "rules"],
                            "properties": {
                                "rules": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["alert", "expr"],
                                        "properties": {"for": {"type": "string"}, "labels": {"type": "object"}},
                                    },
                                }
                            },
                        },
                    }
                },
            },
        },
    },
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "properties": {
                    "scaleTargetRef": {"type": "object", "required": ["name"]},
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            # KEDA reads trigger metadata as strings only.
                            "properties": {"metadata": {"additionalProperties": {"type": "string"}}},
                        },
                    },
                },
            },
        },
    },
}


def test_lint_is_clean_with_defaults_and_every_feature_on():
    for values in VARIANTS.values():
        report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
        problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
        assert not problems and not report["errors"], report


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_object_validates_against_kubernetes_schemas(variant):
    objs = objects(VARIANTS[variant])
    assert objs
    for obj in objs:
        key = (obj["apiVersion"], obj["kind"])
        if key in CRD_SCHEMAS:
            jsonschema.validate(obj, CRD_SCHEMAS[key])
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_refuses_a_bad_object():
    # The test above is only as good as the validator: an unknown field and a wrong type are refused.
    deployment = copy.deepcopy(find(objects(), "Deployment", "generator")[0])
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    deployment = copy.deepcopy(find(objects(), "Deployment", "generator")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_optional_kinds_appear_only_when_enabled():
    kinds = lambda values: sorted(o["kind"] for o in objects(values))  # noqa: E731
    defaults = kinds(None)
    assert defaults == sorted(
        ["ConfigMap", "Secret", "ServiceAccount"]
        + ["Deployment", "Service"] * 2  # generator, controller
        + ["StatefulSet", "Service"] * 2  # trainer, redis
    )
    hpa = kinds(ALL_ON_HPA)
    for kind in ("HorizontalPodAutoscaler", "ServiceMonitor", "PrometheusRule", "NetworkPolicy"):
        assert kind in hpa
    assert "PodMonitor" not in hpa
    assert hpa.count("NetworkPolicy") == 5 and hpa.count("Secret") == 2  # tokens + TLS
    keda = kinds(ALL_ON_KEDA)
    assert "ScaledObject" in keda and "HorizontalPodAutoscaler" not in keda
    assert "PodMonitor" in keda and "ServiceMonitor" not in keda
    assert "Secret" not in keda  # both secrets are existing ones
    external = kinds(EXTERNAL_REDIS)
    assert external.count("StatefulSet") == 1 and external.count("NetworkPolicy") == 3  # no bundled Redis


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_labels_names_and_namespace(variant):
    for obj in objects(VARIANTS[variant]):
        meta = obj["metadata"]
        for label in LABELS:
            assert label in meta["labels"], f"{obj['kind']} {meta['name']} lacks {label}"
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert "namespace" not in meta, "no hard-coded namespace"
        assert len(meta["name"]) <= 63
    for kind in ("Deployment", "StatefulSet"):
        for workload in find(objects(VARIANTS[variant]), kind):
            component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
            assert component in {"generator", "trainer", "controller", "redis", "sandbox"}
            selector = workload["spec"]["selector"]["matchLabels"]
            assert selector["app.kubernetes.io/component"] == component
            assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def test_workloads_run_unprivileged_with_probes_and_gpus():
    objs = objects()
    for kind in ("Deployment", "StatefulSet"):
        for workload in find(objs, kind):
            pod = workload["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["automountServiceAccountToken"] is False
            for c in pod["containers"]:
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
                assert "readinessProbe" in c and "livenessProbe" in c
                assert ":" in c["image"] and not c["image"].endswith(":latest")
    for component in ("generator", "trainer"):
        assert container(objs, component)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in container(objs, "controller")["resources"].get("limits", {})
    # Readiness speaks gRPC health to the service port (plaintext; TLS falls back to TCP).
    assert container(objs, "generator")["readinessProbe"]["grpc"]["port"] == 50052
    assert "tcpSocket" in container(objects(ALL_ON_HPA), "generator")["readinessProbe"]


def test_the_trainer_runs_one_torchrun_rank_per_gpu():
    config = "/etc/sparrow/config/trainer.toml"
    alone = container(objects(), "trainer")  # the default: one GPU, the trainer alone
    assert "command" not in alone and alone["args"] == ["trainer", "--config", config]
    four = container(objects({"trainer": {"gpu": {"count": 4}, "restarts": 5}}), "trainer")
    assert four["command"] == ["python", "-m", "torch.distributed.run"]
    assert four["args"] == [
        "--standalone", "--nproc-per-node", "4", "--max-restarts", "5",
        "--shutdown-timeout", "290",  # the pod's grace period (300 s) less 10 s to checkpoint in, not torchrun's 30
        "-m", "sparrow_cli.main", "trainer", "--config", config,
    ]  # fmt: skip
    assert four["resources"]["limits"]["nvidia.com/gpu"] == 4
    cpu = container(objects({"trainer": {"procs": 3, "gpu": {"count": 0}}}), "trainer")  # gloo ranks, no GPU
    assert cpu["args"][:3] == ["--standalone", "--nproc-per-node", "3"]
    one = container(objects({"trainer": {"procs": 1, "gpu": {"count": 4}}}), "trainer")  # four GPUs, one process
    assert "command" not in one and one["args"][0] == "trainer"
    # DistillSparse and exact alpha run on every rank, as everything else does.
    config = {"alpha": "exact", "distill": {"enabled": True}}
    both = container(objects({"trainer": {"procs": 2, "gpu": {"count": 0}, "config": config}}), "trainer")
    assert both["command"] == ["python", "-m", "torch.distributed.run"] and both["args"][2] == "2"


def test_generator_replicas_are_left_to_the_autoscaler():
    (plain,) = find(objects(), "Deployment", "generator")
    assert plain["spec"]["replicas"] == 2
    for values in (ALL_ON_HPA, ALL_ON_KEDA):
        (scaled,) = find(objects(values), "Deployment", "generator")
        assert "replicas" not in scaled["spec"]
    (hpa,) = find(objects(ALL_ON_HPA), "HorizontalPodAutoscaler", "generator")
    assert hpa["spec"]["scaleTargetRef"]["name"] == plain["metadata"]["name"]
    external = hpa["spec"]["metrics"][0]["external"]
    assert external["metric"]["name"] == "sparrow_generator_queue_outstanding_entries"
    assert external["target"] == {"type": "AverageValue", "averageValue": "8"}
    (scaled_object,) = find(objects(ALL_ON_KEDA), "ScaledObject")
    assert scaled_object["spec"]["scaleTargetRef"]["name"] == plain["metadata"]["name"]
    # Lag alone is 0 whenever the generators keep up: the replicas follow lag + pending, by KEDA's formula
    # over the two triggers named in it.
    modifiers = scaled_object["spec"]["advanced"]["scalingModifiers"]
    assert modifiers["formula"] == "lag + pending" and modifiers["target"] == "8"
    lag, pending = scaled_object["spec"]["triggers"]
    assert (lag["name"], pending["name"]) == ("lag", "pending")
    assert "lagCount" in lag["metadata"] and "pendingEntriesCount" in pending["metadata"]
    for trigger in (lag, pending):
        assert trigger["type"] == "redis-streams"
        assert trigger["metadata"]["stream"] == "sparrow:prompts"
        assert trigger["metadata"]["consumerGroup"] == "generators"
        assert trigger["metadata"]["host"] == f"{RELEASE}-sparrow-redis"


def test_services_and_monitors_select_what_exists():
    objs = objects(ALL_ON_HPA)
    pods = {
        w["metadata"]["labels"]["app.kubernetes.io/component"]: w["spec"]["template"]
        for w in find(objs, "Deployment") + find(objs, "StatefulSet")
    }
    for service in find(objs, "Service"):
        selected = [
            c for c, t in pods.items() if service["spec"]["selector"].items() <= t["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, service["metadata"]["name"]
        port_names = {p["name"] for c in pods[selected[0]]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names
    # Each scraped component exposes exactly one of the monitors' endpoint ports.
    (monitor,) = find(objs, "ServiceMonitor")
    assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/component"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoint_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    for component in ("generator", "trainer", "controller"):
        (service,) = find(objs, "Service", component)
        assert len(endpoint_ports & {p["name"] for p in service["spec"]["ports"]}) == 1
    (redis_service,) = find(objs, "Service", "redis")
    assert not endpoint_ports & {p["name"] for p in redis_service["spec"]["ports"]}


def test_network_policies_let_only_the_services_in():
    objs = objects(ALL_ON_KEDA)
    policies = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p for p in find(objs, "NetworkPolicy")}
    assert set(policies) == {"generator", "trainer", "controller", "redis", "sandbox"}

    def peers(component: str, port: str) -> list[str]:
        out = []
        for rule in policies[component]["spec"]["ingress"]:
            if any(p["port"] == port for p in rule["ports"]):
                for peer in rule["from"]:
                    labels = peer.get("podSelector", {}).get("matchLabels", {})
                    out.append(labels.get("app.kubernetes.io/component") or labels.get("app.kubernetes.io/name"))
                    if "namespaceSelector" in peer and "app" in labels:
                        out[-1] = labels["app"]
        return sorted(out)

    assert peers("trainer", "grpc") == ["generator"]
    assert peers("generator", "control") == ["controller", "trainer"]
    assert peers("generator", "relay") == ["generator"]  # peers fetch policy versions from each other
    assert peers("redis", "redis") == ["controller", "generator", "keda-operator", "trainer"]
    assert peers("sandbox", "http") == ["prometheus", "trainer"] and policies["sandbox"]["spec"]["egress"] == []
    for component, port in (("trainer", "metrics"), ("generator", "metrics"), ("controller", "http")):
        assert "prometheus" in peers(component, port)
    # Policies name ports by name; each name exists on the selected pods.
    pods = {
        w["metadata"]["labels"]["app.kubernetes.io/component"]: w["spec"]["template"]["spec"]
        for w in find(objs, "Deployment") + find(objs, "StatefulSet")
    }
    for component, policy in policies.items():
        names = {p["name"] for c in pods[component]["containers"] for p in c["ports"]}
        for rule in policy["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} <= names


def test_configs_secrets_and_wiring():
    objs = objects(ALL_ON_HPA)
    (config,) = [c for c in find(objs, "ConfigMap") if c["metadata"]["name"].endswith("-config")]
    assert "gpu_memory_utilization = 0.85" in config["data"]["generator.toml"]
    assert "steps = 100" in config["data"]["trainer.toml"]
    env = {e["name"]: e for e in container(objs, "generator")["env"]}
    assert env["SPARROW_QUEUE__URL"]["value"] == f"redis://{RELEASE}-sparrow-redis:6379/0"
    assert env["SPARROW_TRAINER__ADDRESS"]["value"] == f"{RELEASE}-sparrow-trainer:50051"
    assert env["SPARROW_SECURITY__TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "service-token"
    assert env["SPARROW_SECURITY__TLS_CA"]["value"] == "/etc/sparrow/tls/ca.crt"
    controller_env = {e["name"]: e for e in container(objs, "controller")["env"]}
    assert controller_env["SPARROW_RETUNE__TAU"]["value"] == "0.86"
    assert controller_env["SPARROW_API__TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "admin-token"
    # The relay: listening on every address, advertised at the pod's IP, its port on the pod and the Service.
    assert (env["SPARROW_RELAY__ENABLED"]["value"], env["SPARROW_RELAY__HOST"]["value"]) == ("true", "0.0.0.0")
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert (
        env["SPARROW_RELAY__ADVERTISE"]["value"]
        == "$(POD_IP):50053"
        == f"$(POD_IP):{env['SPARROW_RELAY__PORT']['value']}"
    )
    names = [e["name"] for e in container(objs, "generator")["env"]]
    assert names.index("POD_IP") < names.index("SPARROW_RELAY__ADVERTISE")  # $(VAR) expands earlier variables only
    assert {"name": "relay", "containerPort": 50053, "protocol": "TCP"} in container(objs, "generator")["ports"]
    (generators,) = find(objs, "Service", "generator")
    assert any(p["name"] == "relay" and p["port"] == 50053 for p in generators["spec"]["ports"])
    off = objects({"generator": {"relay": {"enabled": False, "port": 50053}}})
    assert not any(e["name"].startswith("SPARROW_RELAY__") for e in container(off, "generator")["env"])
    assert "relay" not in {p["name"] for p in container(off, "generator")["ports"]}
    (tokens,) = [s for s in find(objs, "Secret") if s["type"] == "Opaque"]
    assert set(tokens["data"]) == {"service-token", "admin-token"}
    assert tokens["data"]["service-token"] != tokens["data"]["admin-token"]
    external_env = {e["name"]: e for e in container(objects(EXTERNAL_REDIS), "trainer")["env"]}
    assert external_env["SPARROW_REDIS_URL"]["value"] == "redis://redis.shared.svc:6380/2"
    assert external_env["SPARROW_DEVICE"]["value"] == "cuda"
    (trainer,) = find(objs, "StatefulSet", "trainer")
    (claim,) = trainer["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    mounts = {m["name"]: m["mountPath"] for m in container(objs, "trainer")["volumeMounts"]}
    assert mounts["run"] == "/var/lib/sparrow"


def test_notes_render_for_each_variant():
    for values in VARIANTS.values():
        notes = render(values)["sparrow/templates/NOTES.txt"]
        assert f"svc/{RELEASE}-sparrow-controller" in notes
    assert "Prometheus" in render(ALL_ON_HPA)["sparrow/templates/NOTES.txt"]


def test_the_trainer_and_the_generators_start_on_the_one_model():
    def wiring(values):
        objs = objects(values)
        out = {}
        for kind, component, env_name in (
            ("StatefulSet", "trainer", "SPARROW_MODEL_DIR"),
            ("Deployment", "generator", "SPARROW_ENGINE__MODEL_DIR"),
        ):
            (workload,) = find(objs, kind, component)
            pod = workload["spec"]["template"]["spec"]
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
            claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
            out[component] = env.get(env_name), mounts.get("/models"), claims.get("models")
        return out

    # Their own defaults differ (tiny for the trainer, small for the generators); the chart gives both one.
    assert {c: w[0] for c, w in wiring(None).items()} == {"trainer": "models/small", "generator": "models/small"}
    for model, mount, claim in wiring({"model": {"dir": "/models/qwen3-1.7b", "existingClaim": "ckpt"}}).values():
        assert model == "/models/qwen3-1.7b" and mount["readOnly"] and claim == {"claimName": "ckpt", "readOnly": True}
    # A component's own model_dir wins over the chart's (its TOML, which the environment would override).
    own = wiring({"generator": {"config": {"engine": {"model_dir": "/x"}}}})
    assert own["generator"][0] is None and own["trainer"][0] == "models/small"
