"""Fixtures of the generator's integration tests: real Redis, a stand-in trainer, generators to start."""

import uuid

import pytest
import redis
import torch

from services.generator.config import GeneratorConfig
from sparrow import metrics_contract as mc
from sparrow.config import load_config
from tests.fixtures.standin_rollout_server import StandinRolloutServer
from tests.integration.generator.harness import Harness, generator_overrides
from tests.servers import redis_server

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as server:
        yield server.url


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    c.delete(mc.SCHEDULE_KEY, mc.PROBE_KEY)
    yield c
    c.close()


@pytest.fixture
def trainer():
    with StandinRolloutServer() as server:
        yield server


@pytest.fixture
def start(redis_url, trainer, client, tmp_path):
    """start(engine=None, **overrides) -> a running Harness (on `engine`, or the one the config builds); every
    one started is stopped after the test."""
    harnesses = []

    def _start(engine=None, **overrides) -> Harness:
        name = uuid.uuid4().hex[:8]
        merged = {**generator_overrides(redis_url, trainer.address, tmp_path, name), **overrides}
        h = Harness(load_config(GeneratorConfig, overrides=merged), trainer, client, engine)
        harnesses.append(h)
        return h

    yield _start
    for h in harnesses:
        h.stop()
