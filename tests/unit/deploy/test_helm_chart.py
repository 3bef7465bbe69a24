"""helm/sparrow renders with Helm's real library, lints clean, and every object is valid Kubernetes.

Built-in kinds are validated strictly (unknown fields refused) against the Kubernetes OpenAPI
schemas of `kubernetes-validate` for the oldest (1.29) and newest Kubernetes it ships; the Prometheus
Operator and KEDA kinds, whose CRD schemas are not on disk, against the fields their CRDs require;
the JobSet (several trainer nodes) against its v1alpha2 fields written out by hand from its API
types (unknown fields refused), and the Job template inside it strictly as a batch/v1 Job.
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
    SEVERAL_NODES,
    VARIANTS,
    container,
    find,
    objects,
    pod_template,
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


def _strings(**extra) -> dict:
    return {"type": "array", "items": {"type": "string"}, **extra}


# jobset.x-k8s.io/v1alpha2, from the project's API types (api/jobset/v1alpha2/jobset_types.go): every field of the
# spec and of what the chart fills in, so that a misspelt or misplaced field is refused as the API server would.
_JOBSET_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "action"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"},
        "action": {
            "enum": [
                "FailJobSet",
                "RestartJobSet",
                "RestartJobSetAndIgnoreMaxRestarts",
                "RestartJob",
                "RestartJobAndIgnoreMaxRestarts",
            ]
        },  # fmt: skip
        "onJobFailureReasons": _strings(uniqueItems=True),
        "onJobFailureMessagePatterns": _strings(uniqueItems=True),
        "targetReplicatedJobs": _strings(),
    },
}
JOBSET_SCHEMA = {
    "type": "object",
    "required": ["metadata", "spec"],
    "properties": {
        "metadata": _META,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["replicatedJobs"],
            "properties": {
                "replicatedJobs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "template"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "groupName": {"type": "string"},
                            "replicas": {"type": "integer", "minimum": 0},
                            "template": {"type": "object", "required": ["spec"]},
                            "dependsOn": {"type": "array"},
                        },
                    },
                },
                "network": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "enableDNSHostnames": {"type": "boolean"},
                        "subdomain": {"type": "string"},
                        "publishNotReadyAddresses": {"type": "boolean"},
                    },
                },
                "successPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["operator"],
                    "properties": {"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": _strings()},
                },
                "failurePolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "maxRestarts": {"type": "integer", "minimum": 0},
                        "restartStrategy": {"enum": ["Recreate", "BlockingRecreate", "InPlaceRestart"]},
                        "rules": {"type": "array", "items": _JOBSET_RULE},
                    },
                },
                "startupPolicy": {"type": "object"},
                "suspend": {"type": "boolean"},
                "coordinator": {"type": "object"},
                "managedBy": {"type": "string"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "volumeClaimPolicies": {"type": "array"},
            },
        },
    },
}
CRD_SCHEMAS[("jobset.x-k8s.io/v1alpha2", "JobSet")] = JOBSET_SCHEMA


def _validate_jobset_jobs(jobset: dict) -> None:
    """Each replicated Job's template, strictly, as the batch/v1 Job the JobSet controller makes of it."""
    for replicated in jobset["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": replicated["name"]}}
        job["spec"] = replicated["template"]["spec"]
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(job, version, strict=True)


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
            if obj["kind"] == "JobSet":
                _validate_jobset_jobs(obj)
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
    # The JobSet's hand-written schema and its Job check refuse the same kinds of mistake.
    (jobset,) = find(objects(SEVERAL_NODES), "JobSet")
    for path, value in (
        (("spec", "failurePolicy", "rules", 0, "name"), "setup-error"),  # its names take no hyphen
        (("spec", "failurePolicy", "rules", 0, "action"), "FailJob"),
        (("spec", "network", "enableDnsHostnames"), True),
        (("spec", "successPolicy", "operator"), "Most"),
    ):
        bad = copy.deepcopy(jobset)
        node = bad
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, JOBSET_SCHEMA)
    bad = copy.deepcopy(jobset)
    bad["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][0]["onExitCode"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_jobset_jobs(bad)


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


def test_the_trainer_runs_one_rank_per_gpu():
    config = "/etc/sparrow/config/trainer.toml"
    alone = container(objects(), "trainer")  # the default: one GPU, the trainer alone
    assert "command" not in alone and alone["args"] == ["trainer", "--config", config]
    four = container(objects({"trainer": {"gpu": {"count": 4}, "restarts": 5}}), "trainer")
    assert "command" not in four  # the image's `sparrow`, which starts the ranks itself
    assert four["args"] == [
        "trainer", "--config", config, "--nproc-per-node", "4", "--max-restarts", "5",
        "--set", "distributed.stop_grace_s=290",  # the pod's grace period (300 s) less 10 s to checkpoint in
    ]  # fmt: skip
    assert four["resources"]["limits"]["nvidia.com/gpu"] == 4
    cpu = container(objects({"trainer": {"procs": 3, "gpu": {"count": 0}}}), "trainer")  # gloo ranks, no GPU
    assert cpu["args"][3:5] == ["--nproc-per-node", "3"]
    one = container(objects({"trainer": {"procs": 1, "gpu": {"count": 4}}}), "trainer")  # four GPUs, one process
    assert one["args"] == ["trainer", "--config", config]
    # The flags are the command's own: its parser takes them and they set the [distributed] fields meant.
    from sparrow_cli.main import build_parser

    args = build_parser().parse_args(four["args"])
    assert (args.nproc_per_node, args.max_restarts, args.set) == (4, 5, ["distributed.stop_grace_s=290"])
    # DistillSparse and exact alpha run on every rank, as everything else does.
    both_config = {"alpha": "exact", "distill": {"enabled": True}}
    both = container(objects({"trainer": {"procs": 2, "gpu": {"count": 0}, "config": both_config}}), "trainer")
    assert both["args"][3:5] == ["--nproc-per-node", "2"]


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
    assert env["SPARROW_REDIS__URL"]["value"] == f"redis://{RELEASE}-sparrow-redis:6379/0"
    assert env["SPARROW_TRAINER__ADDRESS"]["value"] == f"{RELEASE}-sparrow-trainer:50051"
    assert env["SPARROW_SECURITY__TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "service-token"
    assert env["SPARROW_SECURITY__TLS_CA"]["value"] == "/etc/sparrow/tls/ca.crt"
    controller_env = {e["name"]: e for e in container(objs, "controller")["env"]}
    assert controller_env["SPARROW_RETUNE__TAU"]["value"] == "0.86"
    assert controller_env["SPARROW_SECURITY__TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "admin-token"
    assert controller_env["SPARROW_REDIS__URL"]["value"] == env["SPARROW_REDIS__URL"]["value"]
    for component in ("generator", "trainer", "controller"):
        names = {e["name"] for e in container(objs, component)["env"]}
        assert not {"SPARROW_QUEUE__URL", "SPARROW_REDIS_URL", "SPARROW_API__TOKEN"} & names, component
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
    assert external_env["SPARROW_REDIS__URL"]["value"] == "redis://redis.shared.svc:6380/2"
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


def test_several_nodes_run_as_one_jobset_with_rank_0_on_pod_0():
    """trainer.nodes 2: one JobSet of 2 indexed pods, each the launcher of its ranks with node rank = its completion
    index and the rendezvous at pod 0's stable name; the trainer Service selects pod 0 (global rank 0 serves); a setup
    error (exit 2) fails the set at once, any other failure recreates every pod `restarts` times."""
    import re

    from sparrow_cli.main import build_parser

    objs = objects(SEVERAL_NODES)
    assert not find(objs, "StatefulSet", "trainer")
    (jobset,) = find(objs, "JobSet", "trainer")
    spec = jobset["spec"]
    (replicated,) = spec["replicatedJobs"]
    job = replicated["template"]["spec"]
    pod = pod_template(jobset)
    c = container(objs, "trainer")
    args = c["args"]

    def flag(name: str) -> str:
        return args[args.index(name) + 1]

    assert replicated["replicas"] == 1
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", 2, 2)
    env = {e["name"]: e for e in c["env"]}
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["SPARROW_DISTRIBUTED__NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == index
    # Pod 0's name under the JobSet's DNS: <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>.
    network = spec["network"]
    assert network["enableDNSHostnames"] is True
    assert flag("--master-addr") == f"{jobset['metadata']['name']}-{replicated['name']}-0-0.{network['subdomain']}"
    (service,) = find(objs, "Service", "trainer")
    assert network["subdomain"] != service["metadata"]["name"]  # the JobSet makes a headless Service of that name
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(flag("--master-port")) == ports["rendezvous"] == 29500
    # 4 GPUs a pod, 4 ranks a pod; restarts are the JobSet's, not each pod's launcher's.
    assert (flag("--nnodes"), flag("--nproc-per-node"), flag("--max-restarts")) == ("2", "4", "0")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    parsed = build_parser().parse_args(args)
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.master_port) == (2, 4, 29500)
    # Generators dial the Service, which selects pod 0 alone.
    selector = dict(service["spec"]["selector"])
    assert selector.pop("batch.kubernetes.io/job-completion-index") == "0"
    assert selector.items() <= pod["metadata"]["labels"].items()
    generator_env = {e["name"]: e.get("value") for e in container(objs, "generator")["env"]}
    assert generator_env["SPARROW_TRAINER__ADDRESS"] == f"{service['metadata']['name']}:50051"
    # Failures: exit 2 fails the Job by its pod failure policy, and that reason fails the set; any other pod failure
    # fails the Job (no retry of one pod alone) and the JobSet recreates every pod.
    assert job["backoffLimit"] == 0 and pod["spec"]["restartPolicy"] == "Never"
    (pod_rule,) = job["podFailurePolicy"]["rules"]
    assert pod_rule == {
        "action": "FailJob",
        "onExitCodes": {"containerName": c["name"], "operator": "In", "values": [2]},
    }
    (rule,) = spec["failurePolicy"]["rules"]
    assert spec["failurePolicy"]["maxRestarts"] == 2
    assert rule["action"] == "FailJobSet" and rule["onJobFailureReasons"] == ["PodFailurePolicy"]
    # Only pod 0 serves: no probe on the others' ports; unprivileged like every workload.
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(c)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] and pod["spec"]["automountServiceAccountToken"] is False
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # The run directory every node writes: one ReadWriteMany claim, kept past an uninstall; or the user's.
    (claim,) = find(objs, "PersistentVolumeClaim", "trainer")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["run"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["run"] == "/var/lib/sparrow"
    theirs = objects({"trainer": {"nodes": 3, "persistence": {"existingClaim": "shared-runs"}}})
    assert not find(theirs, "PersistentVolumeClaim")
    volumes = {v["name"]: v for v in pod_template(find(theirs, "JobSet")[0])["spec"]["volumes"]}
    assert volumes["run"]["persistentVolumeClaim"]["claimName"] == "shared-runs"
    # The trainer pods reach each other on every port (rendezvous, then gloo's or NCCL's own).
    (policy,) = find(objs, "NetworkPolicy", "trainer")
    (peers,) = [r for r in policy["spec"]["ingress"] if "ports" not in r]
    (peer,) = peers["from"]
    assert peer["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert all("ports" in r for r in find(objects(ALL_ON_KEDA), "NetworkPolicy", "trainer")[0]["spec"]["ingress"])
    # The PodMonitor scrapes pod 0 of the trainer (and every pod of no indexed Job).
    (monitor,) = find(objs, "PodMonitor")
    (keep,) = monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_label_batch_kubernetes_io_job_completion_index"]
    assert keep["action"] == "keep"
    assert [bool(re.fullmatch(keep["regex"], v)) for v in ("0", "", "1", "10")] == [True, True, False, False]
    notes = render(SEVERAL_NODES)["sparrow/templates/NOTES.txt"]
    assert "a JobSet of 2 pods x 4 rank(s)" in notes and flag("--master-addr") in notes


def test_one_pod_can_mount_an_existing_claim():
    objs = objects({"trainer": {"persistence": {"existingClaim": "runs"}}})
    (trainer,) = find(objs, "StatefulSet", "trainer")
    assert "volumeClaimTemplates" not in trainer["spec"]
    volumes = {v["name"]: v for v in trainer["spec"]["template"]["spec"]["volumes"]}
    assert volumes["run"]["persistentVolumeClaim"]["claimName"] == "runs"
