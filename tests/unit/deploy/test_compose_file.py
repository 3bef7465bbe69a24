"""docker-compose.yml is a valid Compose file and runs what the Helm chart runs.

No Docker engine exists where the tests run, so the file is held honest without one: it validates
against the Compose Specification's JSON schema (vendored in compose_spec/, see its README), and its
images, ports and environment variable names are compared with the chart's defaults.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import yaml

from tests.unit.deploy.chart_render import REPO, container, find, objects

COMPOSE = REPO / "docker-compose.yml"
SCHEMA = REPO / "tests/unit/deploy/compose_spec/compose-spec.json"
SPARROW = ("generator", "trainer", "controller")
ADDRESSES = {
    "SPARROW_REDIS__URL",
    "SPARROW_TRAINER__ADDRESS",
    "SPARROW_PROMETHEUS__URL",
}
# The pod's IP from the downward API, which a relay advertises to its peers (a Deployment's pod name does not
# resolve); a compose container advertises its hostname, which Docker's DNS resolves.
CHART_ONLY = {"POD_IP", "SPARROW_RELAY__ADVERTISE"}


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def validator() -> jsonschema.Draft201909Validator:
    return jsonschema.Draft201909Validator(json.loads(SCHEMA.read_text()))


def container_ports(service: dict) -> set[int]:
    """Ports the service's containers listen on (`expose` and the container side of `ports`)."""
    ports = {int(p) for p in service.get("expose", [])}
    ports |= {int(str(p).split(":")[-1]) for p in service.get("ports", [])}
    return ports


def test_compose_file_validates_against_the_compose_spec():
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator().iter_errors(compose())]
    assert not errors, errors


def test_the_schema_refuses_a_broken_compose_file():
    broken = copy.deepcopy(compose())
    broken["services"]["generator"]["replica"] = 2
    broken["services"]["trainer"]["ports"] = "50051"
    assert len(list(validator().iter_errors(broken))) >= 2


def test_services_and_scalable_generator():
    services = compose()["services"]
    assert set(services) == {"redis", "prometheus", "grafana", "trainer", "controller", "generator", "sandbox"}
    generator = services["generator"]
    # `docker compose up --scale generator=N` needs no fixed name and no host port.
    assert "container_name" not in generator and "ports" not in generator
    for name in SPARROW:
        build = services[name]["build"]
        assert build["context"] == "." and (REPO / build["dockerfile"]).is_file()
        assert services[name]["command"][0] == name and "entrypoint" not in services[name]  # the image's `sparrow`
    for name in ("generator", "trainer"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
    # The trainer starts one rank per GPU it reserves itself, the same count (one by default), and gives them less
    # time to checkpoint on a stop than compose waits before it kills the container.
    trainer = services["trainer"]
    (device,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    command = trainer["command"]
    assert command[command.index("--nproc-per-node") + 1] == device["count"] == "${SPARROW_TRAINER_GPUS:-1}"
    assert command[command.index("--max-restarts") + 1] == "3"
    grace_s = int(trainer["stop_grace_period"].removesuffix("m")) * 60
    (stop_grace,) = [v for v in command if v.startswith("distributed.stop_grace_s=")]
    assert float(stop_grace.split("=")[1]) < grace_s


def test_images_ports_and_environment_match_the_chart_defaults():
    objs = objects()
    services = compose()["services"]
    for name in SPARROW:
        chart = container(objs, name)
        service = services[name]
        assert service["image"] == chart["image"], name
        assert container_ports(service) == {p["containerPort"] for p in chart["ports"]}, name
        chart_env = {e["name"]: e.get("value") for e in chart["env"]}
        assert set(service["environment"]) == set(chart_env) - CHART_ONLY, name
        for key, value in chart_env.items():
            # Addresses of other services differ (compose service names vs release names), secrets come
            # from elsewhere; every other value (ports, listen hosts, paths, tau, device) is the same.
            if key not in ADDRESSES | CHART_ONLY and value is not None:
                assert str(service["environment"][key]) == value, f"{name}: {key}"
        assert chart["args"][0] == service["command"][0]
    (redis,) = find(objs, "StatefulSet", "redis")
    redis_container = redis["spec"]["template"]["spec"]["containers"][0]
    assert services["redis"]["image"] == redis_container["image"]
    assert container_ports(services["redis"]) == {p["containerPort"] for p in redis_container["ports"]}


def test_prometheus_scrapes_the_compose_services_on_their_ports():
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    env = {name: compose()["services"][name]["environment"] for name in SPARROW}
    assert jobs["trainer"]["static_configs"][0]["targets"] == [f"trainer:{env['trainer']['SPARROW_METRICS__PORT']}"]
    assert jobs["controller"]["static_configs"][0]["targets"] == [
        f"controller:{env['controller']['SPARROW_API__PORT']}"
    ]
    (dns,) = jobs["generator"]["dns_sd_configs"]
    assert dns["names"] == ["generator"] and dns["port"] == int(env["generator"]["SPARROW_METRICS__PORT"])


def test_tokens_come_from_the_environment_not_the_file():
    services = compose()["services"]
    for name, key in (("generator", "SPARROW_SECURITY__TOKEN"), ("trainer", "SPARROW_SECURITY__TOKEN")):
        assert services[name]["environment"][key].startswith("${SPARROW_SERVICE_TOKEN:?")
    assert services["controller"]["environment"]["SPARROW_SECURITY__TOKEN"].startswith("${SPARROW_ADMIN_TOKEN:?")


def test_every_service_spells_the_shared_keys_alike():
    """One security section and one Redis key (services/common/sections.py): no old spelling left here."""
    services = compose()["services"]
    for name in SPARROW:
        env = services[name]["environment"]
        assert not {"SPARROW_QUEUE__URL", "SPARROW_REDIS_URL", "SPARROW_API__TOKEN"} & set(env), name
        assert env["SPARROW_REDIS__URL"] == "redis://redis:6379/0" and "SPARROW_SECURITY__TOKEN" in env, name
