"""A fresh run's first prompts wait for `wait_for_generators` generators (none gets a head start), or go out
at the deadline with a warning; a real trainer service, Redis and gRPC trajectory streams on loopback."""

import logging
import threading
import time
from contextlib import contextmanager

import redis as redis_client

from services.common.grpc_server import GrpcSecurity, open_channel
from services.trainer.service import TrainerService
from sparrow.work import PROMPTS_STREAM
from tests.integration.trainer_service.helpers import RolloutSession
from tests.integration.trainer_service.test_trainer_steps import _config
from tests.servers import redis_server, wait_until


def _queued(url: str) -> int:
    return redis_client.Redis.from_url(url).xlen(PROMPTS_STREAM)


@contextmanager
def _serving(config):
    """The trainer service running in a thread; yields (service, open_session); stops both at the end."""
    service = TrainerService(config)
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    sessions = []
    try:
        wait_until(lambda: service.grpc_port > 0, 60, "trainer serving")
        channel = open_channel(f"127.0.0.1:{service.grpc_port}", GrpcSecurity())

        def session(generator_id: str) -> RolloutSession:
            sessions.append(RolloutSession(channel, generator_id))
            return sessions[-1]

        yield service, session
    finally:
        for s in sessions:
            s.close()
        stop.set()
        thread.join(60)
    assert not thread.is_alive()


def test_the_first_prompts_wait_until_every_generator_has_connected(tmp_path):
    with redis_server() as redis, _serving(_config(tmp_path / "run", redis.url, wait_for_generators=2)) as running:
        service, session = running
        session("gen-a")
        time.sleep(1.5)  # many feeder ticks at poll_s = 0.1: none may enqueue yet
        assert _queued(redis.url) == 0 and service.generators_seen == {"gen-a"}
        session("gen-b")
        wait_until(lambda: _queued(redis.url) > 0, 30, "the first prompts once both generators connected")


def test_at_the_deadline_the_prompts_go_out_with_a_warning_naming_who_came(tmp_path, caplog):
    with redis_server() as redis, caplog.at_level(logging.WARNING, logger="sparrow.trainer"):
        config = _config(tmp_path / "run", redis.url, wait_for_generators=3, wait_for_generators_s=1.0)
        with _serving(config) as (_, session):
            session("gen-a")
            wait_until(lambda: _queued(redis.url) > 0, 30, "the first prompts after the deadline")
    warnings = [r.getMessage() for r in caplog.records if "generators connected" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("1 of 3 generators connected"), warnings
