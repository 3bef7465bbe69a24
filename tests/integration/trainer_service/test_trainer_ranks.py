"""`sparrow trainer` under torchrun, 2 gloo ranks really running: rank 0 serves and publishes, rank 1 follows each
step; a rank killed with SIGKILL ends the trainer within the collective timeout, and a restart resumes from the
checkpoint with no group trained twice; DistillSparse with exact alpha trains on both ranks, its adapter is
published, fetched and loaded by a generator's engine, and a restart resumes it; a config that cannot run on the
ranks asked for is one line, exit 2."""

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


def _write_config(
    path: Path, run_dir: Path, redis_url: str, grpc_port: int, metrics_port: int, top: str = "", tables: str = ""
) -> None:
    path.write_text(
        f"""run_dir = "{run_dir}"
model_dir = "{TINY}"
redis_url = "{redis_url}"
groups_per_step = {GROUPS_PER_STEP}
max_staleness = 1000
poll_s = 0.1
{top}
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
{tables}
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


DISTILL = """[distill]
enabled = true
rank = 4
lr = 0.001
kl_coef = 1.0
backend = "torch"
probe_every = 2
probe_samples = 2
micro_batch_size = 3
"""


@pytest.mark.slow
def test_two_ranks_train_publish_and_resume_the_distill_adapter_with_exact_alpha(tmp_path):
    from services.common.grpc_server import GrpcSecurity
    from services.generator.reference_engine import ReferenceEngine
    from services.generator.weight_fetch import WeightFetcher
    from services.trainer.distill_step import SIDECAR

    run_dir, config, log = tmp_path / "run", tmp_path / "trainer.toml", tmp_path / "trainer.log"
    with redis_server() as redis:
        port, metrics_port = free_port(), free_port()
        _write_config(config, run_dir, redis.url, port, metrics_port, top='alpha = "exact"', tables=DISTILL)
        first = _torchrun(config, log, 2)
        generator = SamplingGenerator(redis.url, f"127.0.0.1:{port}", follow_policy=True, work_dir=tmp_path).start()
        try:
            wait_until(lambda: len(_steps(run_dir)) >= 2, 240, "2 steps on 2 ranks")
            # A generator's own download of adapter 2 (sha256-checked), loaded by its engine below.
            fetched = WeightFetcher(f"127.0.0.1:{port}", GrpcSecurity(), tmp_path / "fetched").fetch("adapter", 2)
            # torchrun passes SIGTERM on (and exits 1 itself, having been signalled): rank 0 checkpoints, then
            # orders the stop.
            first.send_signal(signal.SIGTERM)
            first.wait(120)
            at_stop = _newest(run_dir)
            assert f"trainer stopped at step {at_stop.step}," in log.read_text(), log.read_text()[-4000:]
            second = _torchrun(config, log, 2, "--steps", str(at_stop.step + 2))
            assert second.wait(240) == 0, log.read_text()[-4000:]
        finally:
            generator.close()
            if first.poll() is None:
                first.kill()
    # Loaded once the sampling generator is closed: its thread loads policies, and transformers' loading is not
    # thread-safe within one process.
    engine = ReferenceEngine(TINY, kernel_backend="torch", max_lora_rank=8)
    try:
        engine.load_adapter(fetched.folder, 2)
    finally:
        engine.close()
    rows = _steps(run_dir)
    assert [r["step"] for r in rows] == list(range(1, at_stop.step + 3))
    for r in rows:
        assert r["distill"]["tokens"] > 0 and r["distill"]["kl"] >= 0, r["distill"]
        assert all(b["exact_tokens"] > 0 for b in r["alpha_bins"]), r["alpha_bins"]  # the exact pass ran
        assert ("probe" in r["distill"]) == (r["step"] % 2 == 1)  # probe_every 2, from the first step
    assert json.loads((fetched.folder / SIDECAR).read_text())["adapter_version"] == 2
    assert fetched.manifest.lora_rank == 4
    text = log.read_text()
    assert "rank 1 of 2 follows rank 0" in text and f"rank 1 stops after {at_stop.step} step(s)" in text
    # The restart resumed the adapter (both ranks: their copies are checked equal every step) and its
    # version: nothing published again at the start, and each step's adapter goes out once, in order.
    assert "were published after the checkpoint" not in text and "copies of the DistillSparse adapter" not in text
    final = _newest(run_dir)
    assert final.step == at_stop.step + 2
    kept = [json.loads(p.read_text()) for p in sorted(run_dir.glob(f"adapters/v*/{SIDECAR}"))]
    assert kept and kept[-1]["step"] == final.step
    assert all(a["adapter_version"] == a["step"] for a in kept)  # one version per step, none published twice


@pytest.mark.parametrize(
    ("sets", "procs", "message"),
    [
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
