"""`sparrow trainer` under torchrun, 2 gloo ranks really running: rank 0 serves and publishes (each version a
tensor at a time, over several files), rank 1 follows each step; a rank killed with SIGKILL ends the trainer within
the collective timeout, and a restart resumes from the checkpoint with no group trained twice; a config that cannot
run on the ranks asked for is one line, exit 2."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.trainer.checkpoint import CheckpointManager
from services.trainer.service import STEPS_FILE
from tests.integration.trainer_service.helpers import REPO, TINY, SamplingGenerator
from tests.servers import free_port, redis_server, wait_until

N, GROUPS_PER_STEP = 4, 2
TIMEOUT_S = 20  # the collective timeout of these runs


def _write_config(path: Path, run_dir: Path, redis_url: str, grpc_port: int, metrics_port: int) -> None:
    path.write_text(
        f"""run_dir = "{run_dir}"
model_dir = "{TINY}"
redis_url = "{redis_url}"
groups_per_step = {GROUPS_PER_STEP}
max_staleness = 1000
poll_s = 0.1
[grpc]
address = "127.0.0.1:{grpc_port}"
grace_s = 0.5
[metrics]
port = {metrics_port}
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
micro_batch_size = 3
[checkpoint]
every = 1
keep = 2
[distributed]
timeout_s = {TIMEOUT_S}
[weights]
max_shard_bytes = 40000
"""
    )


def _torchrun(config: Path, log: Path, procs: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
    cmd += ["-m", "sparrow_cli.main", "trainer", "--config", str(config), *args]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def _rank_pid(torchrun: subprocess.Popen, rank: int) -> int:
    """The pid of the worker torchrun started as `rank` (read from its environment)."""
    for child in Path(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no rank {rank} under torchrun {torchrun.pid}")


def _newest(run_dir: Path):
    manager = CheckpointManager(run_dir / "checkpoints", keep=2)
    paths = manager.checkpoints()
    return manager.read_state(paths[-1]) if paths else None


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / STEPS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.slow
def test_two_ranks_train_serve_and_publish_and_a_killed_rank_ends_the_trainer_in_bounded_time(tmp_path):
    run_dir, config, log = tmp_path / "run", tmp_path / "trainer.toml", tmp_path / "trainer.log"
    with redis_server() as redis:
        port, metrics_port = free_port(), free_port()
        _write_config(config, run_dir, redis.url, port, metrics_port)
        first = _torchrun(config, log, 2)
        generator = SamplingGenerator(redis.url, f"127.0.0.1:{port}", follow_policy=True, work_dir=tmp_path).start()
        try:
            wait_until(lambda: len(_steps(run_dir)) >= 2, 240, "2 steps on 2 ranks")
            import urllib.request

            metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            assert "sparrow_trainer_world_size 2.0" in metrics
            assert first.poll() is None, log.read_text()[-3000:]
            os.kill(_rank_pid(first, 1), signal.SIGKILL)
            killed = time.monotonic()
            code = first.wait(TIMEOUT_S + 45)  # the collective timeout, torchrun's 30 s grace at most
            ended_after = time.monotonic() - killed
            at_kill = _newest(run_dir)
            assert code != 0 and at_kill is not None and at_kill.step >= 2
            # The restart: same run dir, 2 ranks again, 2 more steps than the checkpoint holds.
            second = _torchrun(config, log, 2, "--steps", str(at_kill.step + 2))
            assert second.wait(240) == 0, log.read_text()[-4000:]
        finally:
            generator.close()
            if first.poll() is None:
                first.kill()
    assert ended_after < TIMEOUT_S + 45
    final = _newest(run_dir)
    trained = [gid for step in final.history for gid in step]
    assert final.step == at_kill.step + 2 and len(trained) == len(set(trained)) == final.step * GROUPS_PER_STEP
    assert final.history[: at_kill.step] == at_kill.history
    rows = _steps(run_dir)
    versions = [r["published_version"] for r in rows]
    assert versions == sorted(set(versions)), versions  # each version once, rising across the crash
    assert all(r["samples"] == GROUPS_PER_STEP * N and r["loss"] == r["loss"] for r in rows)
    text = log.read_text()
    assert "rank 1 of 2 follows rank 0" in text and "rank 1 stops after 2 step(s)" in text
    assert generator.version > 2  # the generator loaded versions published from the ranks' shards
    latest = max(run_dir.glob("policy/v*/model.safetensors.index.json"))  # each version written over several files
    assert len(list(latest.parent.glob("model-*-of-*.safetensors"))) > 3


@pytest.mark.parametrize(
    ("sets", "procs", "message"),
    [
        (["distill.enabled=true"], 2, "distill.enabled trains the DistillSparse adapter in one trainer process"),
        (["distributed.even_shares=true", "groups_per_step=3"], 2, "do not divide over 2 trainer processes"),
    ],
)
def test_a_config_that_cannot_run_on_the_ranks_is_one_line_exit_2(tmp_path, sets, procs, message):
    env = {**os.environ, "WORLD_SIZE": str(procs), "RANK": "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "sparrow_cli.main", "trainer", "--run-dir", str(tmp_path / "run")]
    for s in [*sets, "sampling.n=3"]:
        cmd += ["--set", s]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists()  # refused before anything starts
