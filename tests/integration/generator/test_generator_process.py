"""`sparrow generator` as real processes: SIGKILL mid-group (a peer reclaims it) and SIGTERM drain (exit 0).

These start generator processes (about 5 s each to import torch and load the model), hence `slow`.
"""

import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid

import pytest

from services.api.sparrow.v1 import rollout_pb2
from sparrow.work import PromptGroup
from tests.cli_runner import REPO
from tests.integration.generator.harness import generator_overrides, group
from tests.servers import wait_until

pytestmark = pytest.mark.slow
ACCEPTED, DUPLICATE = rollout_pb2.ACK_STATUS_ACCEPTED, rollout_pb2.ACK_STATUS_DUPLICATE


def _toml(overrides: dict) -> str:
    """TOML text of dotted overrides (one level of tables, as the generator's config has)."""
    top, tables = [], {}
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        line = f"{name} = {json.dumps(value)}"
        (tables.setdefault(section, []) if section else top).append(line)
    return "\n".join(top + [f"\n[{s}]\n" + "\n".join(lines) for s, lines in tables.items()]) + "\n"


class _Process:
    def __init__(self, overrides: dict, tmp_path) -> None:
        self.overrides = overrides
        name = overrides["generator_id"]
        config = tmp_path / f"{name}.toml"
        config.write_text(_toml(overrides))
        self.log = tmp_path / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sparrow_cli.main", "generator", "--config", str(config)],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        wait_until(self._ready, 120, f"generator {name} serving /metrics")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"generator exited with {self.proc.returncode}:\n{self.log_text()}")
        return bool(self.metrics())

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.overrides['metrics.port']}/metrics"
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read().decode()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def processes():
    started = []
    yield started
    for p in started:
        p.stop()


def _overrides(redis_url, trainer, tmp_path, name, stream, **extra):
    o = generator_overrides(redis_url, trainer.address, tmp_path, name)
    o.update({"generator_id": name, "queue.stream": stream, "queue.dead_letter_stream": f"{stream}:dead"})
    o.update({"control.port": 0, "schedule.follow_redis": False, **extra})
    return o


def test_a_generator_killed_mid_group_is_replaced_and_the_trainer_gets_exactly_n(
    redis_url, client, trainer, tmp_path, processes
):
    stream = f"prompts:{uuid.uuid4().hex[:8]}"
    # The first generator gets samples 0 and 1 through; 2 and 3 vanish on the way, so it waits, unacked.
    trainer.swallow = lambda t: t.generator_id == "gen-a" and t.sample_index >= 2
    a = _Process(_overrides(redis_url, trainer, tmp_path, "gen-a", stream, **{"queue.claim_idle_s": 1.5}), tmp_path)
    processes.append(a)
    client.xadd(stream, group("k", n=4).to_fields())
    trainer.wait_for(lambda: len(trainer.of_group("k")) == 2 and len(trainer.swallowed) == 2, 120, "k half-sent")
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(30)
    (pending,) = client.xpending_range(stream, "generators", "-", "+", 10)
    assert pending["consumer"] == b"gen-a"  # left behind by the dead generator

    b = _Process(_overrides(redis_url, trainer, tmp_path, "gen-b", stream, **{"queue.claim_idle_s": 1.5}), tmp_path)
    processes.append(b)
    trainer.wait_for(lambda: len(trainer.of_group("k")) == 4, 120, "k complete")
    wait_until(lambda: client.xpending(stream, "generators")["pending"] == 0, 60, "k acked by gen-b")
    stored = trainer.of_group("k")
    assert [t.trajectory_id for t in stored] == ["k/0/0", "k/0/1", "k/0/2", "k/0/3"]
    assert [t.generator_id for t in stored] == ["gen-a", "gen-a", "gen-b", "gen-b"]
    statuses = {}
    for tid, status in trainer.statuses:
        statuses.setdefault(tid, []).append(status)
    assert statuses == {
        "k/0/0": [ACCEPTED, DUPLICATE],  # gen-b's new samples for indices gen-a got through are duplicates
        "k/0/1": [ACCEPTED, DUPLICATE],
        "k/0/2": [ACCEPTED],
        "k/0/3": [ACCEPTED],
    }
    assert 'sparrow_generator_groups_total{outcome="reclaimed"} 1.0' in b.metrics()
    assert 'sparrow_generator_groups_total{outcome="done"} 1.0' in b.metrics()

    b.proc.send_signal(signal.SIGTERM)
    assert b.proc.wait(60) == 0, b.log_text()


def test_sigterm_drains_hands_back_the_unfinished_group_and_exits_0(
    redis_url, client, trainer, tmp_path, processes, start
):
    stream = f"prompts:{uuid.uuid4().hex[:8]}"
    trainer.swallow = lambda t: t.group_id == "d"  # d can never finish on this generator
    c = _Process(_overrides(redis_url, trainer, tmp_path, "gen-c", stream, drain_grace_s=1.0), tmp_path)
    processes.append(c)
    client.xadd(stream, group("d", n=2).to_fields())
    client.xadd(stream, group("e", n=1, seed=2).to_fields())
    trainer.wait_for(lambda: len(trainer.swallowed) == 2 and len(trainer.of_group("e")) == 1, 120, "d sent, e done")
    wait_until(lambda: client.xpending(stream, "generators")["pending"] == 1, 30, "e acked")
    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(60) == 0, c.log_text()
    assert "drained: 0 groups finished, 1 handed back" in c.log_text()
    assert client.xpending(stream, "generators")["pending"] == 0
    last = PromptGroup.from_fields(client.xrevrange(stream, count=1)[0][1])
    assert last.group_id == "d" and last.attempt == 0

    trainer.swallow = None  # the handed-back copy is generated by the next generator: nothing was lost
    h = start(**{"queue.stream": stream, "queue.dead_letter_stream": f"{stream}:dead"})
    h.wait_settled({"d": 2})
    assert [t.trajectory_id for t in trainer.of_group("d")] == ["d/0/0", "d/0/1"]
