"""A trainer process killed with SIGKILL mid-run and started again: it resumes from its checkpoint, the
generator reconnects, every fully accepted group is trained exactly once (or still waits, stored), policy
versions only go up, and SIGTERM stops it cleanly with a checkpoint."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.trainer.checkpoint import CheckpointManager
from services.trainer.ledger import OUTSTANDING, GroupLedger
from services.trainer.service import STEPS_FILE
from services.trainer.store import TrajectoryStore
from tests.integration.trainer_service.helpers import REPO, TINY, SamplingGenerator
from tests.servers import free_port, redis_server, wait_until

N, GROUPS_PER_STEP = 4, 2


def _write_config(path: Path, run_dir: Path, redis_url: str, grpc_port: int) -> None:
    path.write_text(
        f"""run_dir = "{run_dir}"
model_dir = "{TINY}"
groups_per_step = {GROUPS_PER_STEP}
outstanding_steps = 2.0
max_staleness = 1000          # this generator keeps the starting policy; lag is not under test here
poll_s = 0.1
[redis]
url = "{redis_url}"
[grpc]
address = "127.0.0.1:{grpc_port}"
grace_s = 0.5
[metrics]
port = {free_port()}
bin_width = 16
num_bins = 4
[task]
pairs = 4
max_hops = 2
[sampling]
n = {N}
max_new_tokens = 16
[optim]
lr = 0.001
[checkpoint]
every = 1
keep = 2
"""
    )


def _start(config: Path, log: Path, steps: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "sparrow_cli.main", "trainer", "--config", str(config), "--steps", str(steps)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _newest(run_dir: Path):
    manager = CheckpointManager(run_dir / "checkpoints", keep=2)
    paths = manager.checkpoints()
    return manager.read_state(paths[-1]) if paths else None


def _complete(generator: SamplingGenerator) -> set[str]:
    return {gid for gid, done in dict(generator.accepted).items() if len(done) == N}


@pytest.mark.slow
def test_kill_9_and_restart_neither_loses_nor_retrains_accepted_trajectories(tmp_path):
    run_dir, config, log = tmp_path / "run", tmp_path / "trainer.toml", tmp_path / "trainer.log"
    with redis_server() as redis:
        port = free_port()
        _write_config(config, run_dir, redis.url, port)
        first = _start(config, log, steps=0)
        generator = SamplingGenerator(redis.url, f"127.0.0.1:{port}").start()
        try:

            def checkpointed_with_untrained_groups() -> bool:
                state = _newest(run_dir)
                if state is None or state.step < 2:
                    return False
                done = {gid for step in state.history for gid in step}
                return bool(_complete(generator) - done - set(state.dropped))

            wait_until(checkpointed_with_untrained_groups, 120, "2 steps and accepted groups not yet trained")
            assert first.poll() is None, log.read_text()[-2000:]
            first.send_signal(signal.SIGKILL)
            first.wait(30)
            at_kill = _newest(run_dir)
            trained_at_kill = {gid for step in at_kill.history for gid in step}
            waiting_at_kill = _complete(generator) - trained_at_kill - set(at_kill.dropped)
            errors_at_kill = generator.errors

            second = _start(config, log, steps=at_kill.step + 3)
            assert second.wait(180) == 0, log.read_text()[-3000:]
        finally:
            generator.close()
            if first.poll() is None:
                first.kill()
    final = _newest(run_dir)
    trained = [gid for step in final.history for gid in step]
    assert final.step == at_kill.step + 3 and len(final.history) == final.step
    assert len(trained) == len(set(trained)) == final.step * GROUPS_PER_STEP  # nothing trained twice
    assert final.history[: at_kill.step] == at_kill.history  # the resumed lineage continues the old one
    assert generator.errors > errors_at_kill  # the generator lost the trainer and reconnected
    store, ledger = TrajectoryStore(run_dir), GroupLedger(run_dir, finished=final.finished)
    for gid in _complete(generator):  # nothing accepted is lost: trained, or stored and waiting for a step
        waiting = ledger.state(gid) == OUTSTANDING and store.count(gid) == N
        assert gid in trained or gid in final.dropped or waiting, gid
    assert waiting_at_kill & set(trained), "groups accepted before the kill were trained after the restart"
    versions = [json.loads(line)["published_version"] for line in (run_dir / STEPS_FILE).read_text().splitlines()]
    assert versions == sorted(set(versions)), versions  # each version once, rising across the crash


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_cleanly(tmp_path):
    run_dir, config, log = tmp_path / "run", tmp_path / "trainer.toml", tmp_path / "trainer.log"
    with redis_server() as redis:
        _write_config(config, run_dir, redis.url, free_port())
        proc = _start(config, log, steps=0)
        wait_until(lambda: (run_dir / "endpoints.json").is_file(), 60, "trainer serving")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-2000:]
    state = _newest(run_dir)
    assert state is not None and state.step == 0 and state.feeder["position"] >= 2 * GROUPS_PER_STEP
    assert "trainer stopped at step 0, policy v1" in log.read_text()


def test_versions_published_after_the_last_checkpoint_are_never_reused(tmp_path):
    from services.trainer.config import TrainerServiceConfig
    from services.trainer.service import TrainerService
    from services.trainer.weights import POLICY, WeightStore
    from sparrow.config import load_config
    from trainer.model_io import load_model

    overrides = {"run_dir": str(tmp_path), "model_dir": str(TINY), "redis.url": "redis://127.0.0.1:1/0"}
    config = load_config(TrainerServiceConfig, overrides=overrides)
    fresh = TrainerService(config)  # Redis is not touched before the loop runs
    assert fresh.state.policy_version == 1 and fresh.weights.latest(POLICY) == 1
    fresh.shutdown()  # checkpoints step 0 at version 1
    # Versions 2 and 3 went out, then the process died before checkpointing them.
    store = WeightStore(tmp_path, keep=3)
    for v in (2, 3):
        store.publish(POLICY, v, lambda out: (out / "model.safetensors").write_bytes(b"lost"))
    resumed = TrainerService(config)
    assert resumed.state.step == 0 and resumed.state.policy_version == 4  # the checkpoint's policy, as v4
    base = load_model(TINY)
    republished = load_model(resumed.weights.folder(POLICY, 4))
    assert all(
        torch.equal(a, b) for a, b in zip(base.state_dict().values(), republished.state_dict().values(), strict=True)
    )
    resumed.shutdown()
