"""A fresh run's first prompts wait for `wait_for_generators` generators (none gets a head start), or go out
at the deadline with a warning; a real trainer service, Redis and gRPC trajectory streams on loopback."""

import logging
import threading
import time

import redis as redis_client

from services.common.grpc_server import GrpcSecurity, open_channel
from services.trainer.service import TrainerService
from sparrow.work import PROMPTS_STREAM
from tests.integration.trainer_service.helpers import RolloutSession
from tests.integration.trainer_service.test_trainer_steps import _config
from tests.servers import redis_server, wait_until


def _queued(url: str) -> int:
    return redis_client.Redis.from_url(url).xlen(PROMPTS_STREAM)


def _serving(config):
    service = TrainerService(config)
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    wait_until(lambda: service.grpc_port > 0, 60, "trainer serving")
    return service, stop, thread


def test_the_first_prompts_wait_until_every_generator_has_connected(tmp_path):
    with redis_server() as redis:
        config = _config(tmp_path / "run", redis.url, wait_for_generators=2)
        service, stop, thread = _serving(config)
        sessions = []
        try:
            channel = open_channel(f"127.0.0.1:{service.grpc_port}", GrpcSecurity())
            sessions.append(RolloutSession(channel, "gen-a"))
            time.sleep(1.5)  # many feeder ticks at poll_s = 0.1: none may enqueue yet
            assert _queued(redis.url) == 0 and service.generators_seen == {"gen-a"}
            sessions.append(RolloutSession(channel, "gen-b"))
            wait_until(lambda: _queued(redis.url) > 0, 30, "the first prompts once both generators connected")
        finally:
            for s in sessions:
                s.close()
            stop.set()
            thread.join(60)
        assert not thread.is_alive()


def test_at_the_deadline_the_prompts_go_out_with_a_warning_naming_who_came(tmp_path, caplog):
    with redis_server() as redis:
        config = _config(tmp_path / "run", redis.url, wait_for_generators=3, wait_for_generators_s=1.0)
        with caplog.at_level(logging.WARNING, logger="sparrow.trainer"):
            service, stop, thread = _serving(config)
            sessions = []
            try:
                channel = open_channel(f"127.0.0.1:{service.grpc_port}", GrpcSecurity())
                sessions.append(RolloutSession(channel, "gen-a"))
                wait_until(lambda: _queued(redis.url) > 0, 30, "the first prompts after the deadline")
            finally:
                for s in sessions:
                    s.close()
                stop.set()
                thread.join(60)
        assert not thread.is_alive()
        warnings = [r.getMessage() for r in caplog.records if "generators connected" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].startswith("1 of 3 generators connected"), warnings
