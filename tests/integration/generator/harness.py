"""A generator (reference engine on the committed tiny model) in this process, and what it talks to."""

import urllib.request
from pathlib import Path

import redis

from services.generator.config import GeneratorConfig
from sparrow.work import PromptGroup, Sampling
from tests.fixtures.standin_rollout_server import StandinRolloutServer
from tests.servers import free_port
from tests.unit.generator.tiny_models import SMALL, TINY, chain_prompt

__all__ = ["SMALL", "TINY", "Harness", "chain_prompt", "generator_overrides", "group"]


def group(gid: str, n: int = 2, max_new_tokens: int = 12, seed: int = 1, pairs: int = 8, **kw) -> PromptGroup:
    """A prompt group of a chain-task prompt (`pairs` pairs: 3 * pairs + 5 tokens)."""
    prompt = tuple(chain_prompt(pairs, 4, seed))
    return PromptGroup(gid, prompt, n, 0, Sampling(max_new_tokens=max_new_tokens), **kw)


def generator_overrides(redis_url: str, trainer_address: str, tmp_path: Path, name: str) -> dict:
    """Config overrides for a fast generator on loopback: short timeouts, its own stream names."""
    return {
        "generator_id": f"gen-{name}",
        "redis.url": redis_url,
        "queue.stream": f"prompts:{name}",
        "queue.dead_letter_stream": f"prompts:{name}:dead",
        "queue.claim_idle_s": 2.0,
        "queue.max_attempts": 2,
        "trainer.address": trainer_address,
        "trainer.reconnect_initial_s": 0.05,
        "trainer.reconnect_max_s": 0.5,
        "trainer.weights_dir": str(tmp_path / f"weights-{name}"),
        "trainer.fetch_chunk_bytes": 65536,
        "engine.kind": "reference",
        "engine.model_dir": str(TINY),
        "engine.kernel_backend": "torch",
        "engine.device": "cpu",
        "engine.max_model_len": 256,
        "engine.max_lora_rank": 8,
        "schedule.poll_s": 0.5,
        "metrics.host": "127.0.0.1",
        "metrics.port": free_port(),
        "control.host": "127.0.0.1",
        "control.port": 0,
        "drain_grace_s": 5.0,
    }


class Harness:
    """One in-process generator plus handles on what it talks to."""

    def __init__(
        self, config: GeneratorConfig, trainer: StandinRolloutServer, client: redis.Redis, engine=None
    ) -> None:
        from services.generator.main import Generator

        self.config, self.trainer, self.redis = config, trainer, client
        self.generator = Generator(config, engine)  # engine None: the one the config builds
        self.thread = self.generator.run_in_background()

    @property
    def service(self):
        return self.generator.service

    def enqueue(self, g: PromptGroup) -> str:
        return self.redis.xadd(self.config.queue.stream, g.to_fields()).decode()

    def pending(self) -> int:
        try:
            return self.redis.xpending(self.config.queue.stream, self.config.queue.group)["pending"]
        except redis.ResponseError:  # no group yet
            return -1

    def dead(self) -> list[dict]:
        entries = self.redis.xrange(self.config.queue.dead_letter_stream)
        return [{k.decode(): v.decode() for k, v in f.items()} for _, f in entries]

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.generator.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, **labels) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.metrics_text()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        raise KeyError(f"{name}{labels} not exported")

    def wait_settled(self, groups: dict[str, int], timeout: float = 60) -> None:
        """Until the trainer holds n trajectories of each group and no entry is pending."""
        self.trainer.wait_for(
            lambda: all(len(self.trainer.of_group(g)) >= n for g, n in groups.items()), timeout, f"groups {groups}"
        )
        self.trainer.wait_for(lambda: self.pending() == 0, timeout, "every entry acked")

    def stop(self) -> None:
        if self.thread.is_alive():
            self.service.request_drain(0.0, exit_after=True)
            self.thread.join(30)
        self.generator.close()
        self.generator.engine.close()
