"""The Ray Serve application's pieces without a Ray cluster: its config file against Ray's own schema,
the lag-based autoscaling policy, the lag reading against a real Redis, and per-replica overrides.
(tests/integration/deploy/test_ray_generators.py runs the app on a local Ray cluster.)"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import redis
import yaml

from services.generator.work_queue import Backlog, consumer_group_backlog
from services.generator_ray.autoscale import OUTSTANDING_METRIC, OutstandingGroupsPolicy
from tests.servers import redis_server
from tests.unit.deploy.chart_render import REPO

SERVE_APP = REPO / "deploy/ray/serve_app.yaml"


def resolve(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_serve_app_config_is_valid_for_ray_serve():
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load(SERVE_APP.read_text())
    schema = ServeDeploySchema.model_validate(doc)
    (app,) = schema.applications
    (deployment,) = app.deployments
    from services.generator_ray.app import GeneratorReplica, build_app

    assert resolve(app.import_path) is build_app
    assert deployment.name == GeneratorReplica.name
    autoscaling = AutoscalingConfig(**deployment.autoscaling_config)
    assert autoscaling.min_replicas >= 1  # the lag is reported by replicas: never scale to zero
    assert resolve(autoscaling.policy.policy_function) is OutstandingGroupsPolicy
    OutstandingGroupsPolicy(**autoscaling.policy.policy_kwargs)
    assert deployment.ray_actor_options.num_gpus == 1


def test_serve_app_overrides_are_generator_config_keys():
    from services.generator.config import GeneratorConfig
    from sparrow.config import load_config

    args = yaml.safe_load(SERVE_APP.read_text())["applications"][0]["args"]
    config = load_config(GeneratorConfig, None, args["overrides"])
    assert config.queue.stream == "sparrow:prompts" and config.queue.group == "generators"


def test_build_app_refuses_unknown_args():
    from services.generator_ray.app import build_app

    with pytest.raises(ValueError, match="unknown application args: replicas"):
        build_app({"replicas": 2})
    assert build_app({"overrides": {"engine.kind": "reference"}}) is not None


def test_each_replica_gets_its_own_id_and_free_ports_unless_pinned():
    from services.generator_ray.app import replica_overrides

    a, b = replica_overrides({}, "abc"), replica_overrides({}, "def")
    assert a["generator_id"] != b["generator_id"] and a["generator_id"].endswith("-abc")
    assert a["control.port"] == 0 and a["metrics.port"] == 0
    pinned = replica_overrides({"metrics.port": 9102, "generator_id": "g1"}, "abc")
    assert pinned["metrics.port"] == 9102 and pinned["generator_id"] == "g1"


def context(reported: dict[str, float] | None, target: int = 2) -> SimpleNamespace:
    metrics = None if reported is None else {OUTSTANDING_METRIC: reported}
    return SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=target)


def test_policy_asks_for_outstanding_groups_over_target_replicas():
    policy = OutstandingGroupsPolicy(target_groups_per_replica=8)
    assert policy(context({"r1": 16.0, "r2": 15.0}))[0] == 2  # the trainer's 16 outstanding groups at defaults
    assert policy(context({"r1": 33.0}))[0] == 5  # ceil(33 / 8)
    assert policy(context({"r1": 0.0}))[0] == 1  # never asks for zero: Ray applies min_replicas
    assert policy(context(None, target=3))[0] == 3  # nothing reported yet: hold
    assert policy(context({}, target=5))[0] == 5
    with pytest.raises(ValueError):
        OutstandingGroupsPolicy(target_groups_per_replica=0)


def test_the_backlog_is_read_from_the_consumer_group():
    # Lag alone is 0 whenever the generators keep up; lag + pending is the work they hold or await.
    with redis_server() as server:
        client = redis.Redis.from_url(server.url)
        assert consumer_group_backlog(client, "prompts", "generators") is None  # no stream yet
        client.xgroup_create("prompts", "generators", id="0", mkstream=True)
        for i in range(5):
            client.xadd("prompts", {"group": str(i)})
        assert consumer_group_backlog(client, "prompts", "generators") == Backlog(lag=5, pending=0)
        client.xreadgroup("generators", "g1", {"prompts": ">"}, count=2)
        backlog = consumer_group_backlog(client, "prompts", "generators")
        assert backlog == Backlog(lag=3, pending=2) and backlog.outstanding == 5
        client.xack("prompts", "generators", *[e for e, _ in client.xrange("prompts", count=1)])
        assert consumer_group_backlog(client, "prompts", "generators").outstanding == 4
        assert consumer_group_backlog(client, "prompts", "other-group") is None
        client.close()
