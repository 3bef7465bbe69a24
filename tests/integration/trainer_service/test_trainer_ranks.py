"""`sparrow trainer` over 2 gloo ranks really running, started by a user's own torchrun and by `sparrow trainer
--nproc-per-node 2` itself: rank 0 serves and publishes (each version a
tensor at a time, over several files), rank 1 follows each step; a rank killed with SIGKILL ends the
trainer within the collective timeout, a restart resumes from the checkpoint with no group trained twice, and SIGTERM
to the launcher stops the ranks after their checkpoint with exit 0; DistillSparse with exact alpha trains on both
ranks, its adapter is published, fetched and loaded by a generator's engine, and a restart resumes it. What cannot run
(a world size the config refuses, a checkpoint of another model) is one line, exit 2, before any rank starts; a setup
error only the ranks meet is exit 2 too, and not restarted."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.trainer.checkpoint import CheckpointManager, TrainState
from services.trainer.service import STEPS_FILE
from tests.integration.trainer_service.helpers import REPO, TINY, SamplingGenerator
from tests.servers import free_port, redis_server, wait_until

N, GROUPS_PER_STEP = 4, 2
TIMEOUT_S = 20  # the collective timeout of these runs
STOP_GRACE_S = 120  # a step and its checkpoint on a loaded 2-core machine fit in it


def _write_config(
    path: Path, run_dir: Path, redis_url: str, grpc_port: int, metrics_port: int, top: str = "", tables: str = ""
) -> None:
    path.write_text(
        f"""run_dir = "{run_dir}"
model_dir = "{TINY}"
groups_per_step = {GROUPS_PER_STEP}
max_staleness = 1000
poll_s = 0.1
{top}
[redis]
url = "{redis_url}"
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
stop_grace_s = {STOP_GRACE_S}
[weights]
max_shard_bytes = 40000
{tables}
"""
    )


def _torchrun(config: Path, log: Path, procs: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
    cmd += ["-m", "sparrow_cli.main", "trainer", "--config", str(config), *args]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def _sparrow_trainer(config: Path, log: Path, *args: str) -> subprocess.Popen:
    """`sparrow trainer --config CONFIG ARGS`, its output appended to `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "sparrow_cli.main", "trainer", "--config", str(config), *args]
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
    """A user's torchrun runs 2 ranks; rank 1 is SIGKILLed after 2 steps and torchrun ends non-zero within the
    collective timeout. `sparrow trainer --nproc-per-node 2` then resumes the run from its checkpoint and, on SIGTERM
    after 2 more steps, has its ranks checkpoint and stop: exit 0, every step's groups trained once, versions rising."""
    run_dir, config, log = tmp_path / "run", tmp_path / "trainer.toml", tmp_path / "trainer.log"
    with redis_server() as redis:
        port, metrics_port = free_port(), free_port()
        _write_config(config, run_dir, redis.url, port, metrics_port)
        first, second = _torchrun(config, log, 2), None
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
            # The restart: same run dir, 2 ranks again, now started by `sparrow trainer` itself and trained until
            # SIGTERM, which it passes on: rank 0 checkpoints and stops the other, both exit 0, and so does it.
            second = _sparrow_trainer(config, log, "--nproc-per-node", "2")
            # The generator follows the policy only when it takes a new group: the restart's steps may train on
            # groups it sampled before, so it is waited for too (it must load a version the ranks published).
            wait_until(
                lambda: _newest(run_dir).step >= at_kill.step + 2 and generator.version > 2,
                240,
                "2 steps after the restart, and the generator on a policy published by the ranks",
                explain=generator.describe,
            )
            second.send_signal(signal.SIGTERM)
            assert second.wait(STOP_GRACE_S + 30) == 0, log.read_text()[-4000:]
        finally:
            generator.close()
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.kill()
    assert ended_after < TIMEOUT_S + 45
    final = _newest(run_dir)
    trained = [gid for step in final.history for gid in step]
    assert final.step >= at_kill.step + 2 and len(trained) == len(set(trained)) == final.step * GROUPS_PER_STEP
    assert final.history[: at_kill.step] == at_kill.history
    rows = _steps(run_dir)
    assert [r["step"] for r in rows][-1] == final.step  # the stop came after the last step's checkpoint
    versions = [r["published_version"] for r in rows]
    assert versions == sorted(set(versions)), versions  # each version once, rising across the crash
    assert all(r["samples"] == GROUPS_PER_STEP * N and r["loss"] == r["loss"] for r in rows)
    text = log.read_text()
    assert text.count("rank 1 of 2 follows rank 0") == 2  # the user's torchrun's ranks, then the launcher's
    assert "SIGTERM: passing it on to 2 trainer process(es)" in text
    assert re.search(rf"rank 1 stops after {final.step - at_kill.step} step\(s\)", text), text[-3000:]
    assert generator.version > 2  # the generator loaded versions published from the ranks' shards
    latest = max(run_dir.glob("policy/v*/model.safetensors.index.json"))  # each version written over several files
    assert len(list(latest.parent.glob("model-*-of-*.safetensors"))) > 3


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
    ("args", "world", "message"),
    [
        # A rank (WORLD_SIZE set, as torchrun does) refuses what it cannot run before it joins the group.
        (["--set", "distributed.even_shares=true", "--set", "groups_per_step=3"], 2, "do not divide over 2 trainer"),
        # The launcher (no WORLD_SIZE) refuses the same before any rank starts, for the whole world of all nodes.
        (["--nproc-per-node", "0"], None, "distributed.procs_per_node"),
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"]
            + ["--set", "distributed.even_shares=true", "--set", "groups_per_step=3"],
            None,
            "9 samples (groups_per_step 3 x sampling.n 3) do not divide over 4 trainer processes",
        ),
    ],
)
def test_a_config_that_cannot_run_on_the_ranks_is_one_line_exit_2(tmp_path, args, world, message):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    if world is not None:
        env |= {"WORLD_SIZE": str(world), "RANK": "0"}
    cmd = [sys.executable, "-m", "sparrow_cli.main", "trainer", "--run-dir", str(tmp_path / "run"), *args]
    r = subprocess.run([*cmd, "--set", "sampling.n=3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists()  # refused before anything starts


@pytest.fixture(scope="module")
def tiny_checkpoint_and_another_model(tmp_path_factory) -> tuple[Path, Path]:
    """A run dir holding a checkpoint of models/tiny, and a model folder of another shape (hidden 32, not 64)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model_io import load_model

    root = tmp_path_factory.mktemp("other-model")
    other = root / "other"
    other.mkdir()
    for f in TINY.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, other / f.name)
    config = json.loads((TINY / "config.json").read_text()) | {"hidden_size": 32, "intermediate_size": 64}
    (other / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(other)).save_pretrained(other)
    model = load_model(TINY)
    CheckpointManager(root / "run" / "checkpoints", keep=2).save(
        model, torch.optim.AdamW(model.parameters()), TrainState(run_id="tiny", step=1)
    )
    return root / "run", other


@pytest.mark.parametrize("procs", ["1", "2"])
def test_a_checkpoint_of_another_model_is_one_line_exit_2_before_any_rank_starts(
    tiny_checkpoint_and_another_model, procs
):
    """The run dir's newest checkpoint is models/tiny's; the config names a model of another shape: the launcher (and
    the one process alike) names the checkpoint and the first tensor that differs, and leaves the run dir as it was."""
    run_dir, other = tiny_checkpoint_and_another_model
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    cmd = [sys.executable, "-m", "sparrow_cli.main", "trainer", "--run-dir", str(run_dir), "--model-dir", str(other)]
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"} | {"OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [*cmd, "--nproc-per-node", procs], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "step-000000001 is a checkpoint of another model than" in r.stderr
    assert "is [521, 64] there and [521, 32] in the model" in r.stderr
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


@pytest.mark.slow
@pytest.mark.parametrize("dies", [False, True], ids=["exit-2", "killed-after-its-note"])
def test_a_setup_error_the_ranks_meet_is_exit_2_and_not_restarted(tiny_checkpoint_and_another_model, tmp_path, dies):
    """Checkpoint shards overwritten with garbage pass the launcher's checks (their metadata is whole) but load on no
    rank: each rank exits 2 (one line), and the launcher, though allowed 2 restarts, starts them once and exits 2 where
    torchrun would have started them 3 times and exited 1. `dies`: each rank is killed right after noting its setup
    error (the fault point), as when one rank's exit takes the other down in a collective (CI once saw SIGABRT and a
    restart): the launcher reads the ranks' notes, not only their exit status."""
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_checkpoint_and_another_model[0], run_dir)
    for shard in run_dir.glob("checkpoints/step-*/state/*.distcp"):
        shard.write_bytes(b"garbage")
    cmd = [sys.executable, "-m", "sparrow_cli.main", "trainer", "--run-dir", str(run_dir), "--model-dir", str(TINY)]
    cmd += ["--nproc-per-node", "2", "--max-restarts", "2", "--grpc-address", "127.0.0.1:0", "--metrics-port", "0"]
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"} | {"OMP_NUM_THREADS": "1"}
    env["PYTHONFAULTHANDLER"] = "1"  # a crash on the way out shows where it was
    env.pop("SPARROW_FAULT", None)
    if dies:
        env["SPARROW_FAULT"] = "trainer:setup-error"
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert r.stderr.count("starting 2 trainer process(es)") == 1
    if dies:
        # the rank killed first, at least: the agent may stop the other before it gets to its note
        said = r"rank \d: signal SIGKILL after its setup error"
        assert re.search(rf"stopped with a setup error \(.*{said}.*\); not started again", r.stderr), r.stderr[-3000:]
    else:
        assert "sparrow trainer: error: no checkpoint under" in r.stderr
        assert re.search(r"stopped with a setup error \(.*exit 2.*\); not started again", r.stderr), r.stderr[-3000:]
    assert "starting them again" not in r.stderr
