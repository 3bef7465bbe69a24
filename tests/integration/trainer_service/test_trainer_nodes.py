"""The trainer over 2 nodes, really: two `sparrow trainer` launchers on loopback with the arguments the Helm chart
renders for `trainer.nodes = 2` (pod 0's DNS name replaced by 127.0.0.1, the node rank given as the chart gives it,
from the pod's completion index), one gloo rank each, against Redis and a sampling generator."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.trainer_service.helpers import REPO, SamplingGenerator
from tests.integration.trainer_service.test_trainer_ranks import (
    GROUPS_PER_STEP,
    TIMEOUT_S,
    _newest,
    _steps,
    _write_config,
)
from tests.servers import free_port, redis_server, wait_until

CHART_VALUES = {
    "trainer": {"nodes": 2, "procs": 1, "gpu": {"count": 0}, "persistence": {"accessModes": ["ReadWriteMany"]}}
}
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _chart_command(config: Path, master_port: int) -> tuple[list[str], str]:
    """The trainer container's arguments as the chart renders them for 2 nodes, with this machine's config file,
    loopback for pod 0's name and a free rendezvous port; and the variable that carries the node rank."""
    from tests.unit.deploy.chart_render import container, objects

    c = container(objects(CHART_VALUES), "trainer")
    args = list(c["args"])
    (rank_var,) = [
        e["name"] for e in c["env"] if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == INDEX_FIELD
    ]
    for flag, value in (("--config", str(config)), ("--master-addr", "127.0.0.1"), ("--master-port", str(master_port))):
        args[args.index(flag) + 1] = value
    assert args[args.index("--nnodes") + 1] == "2" and args[args.index("--nproc-per-node") + 1] == "1"
    return args, rank_var


def _node(args: list[str], rank_var: str, index: int, log: Path, *extra: str) -> subprocess.Popen:
    """Pod `index`: `sparrow <the chart's args>`, its node rank from the variable the chart sets."""
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"} | {"OMP_NUM_THREADS": "1", rank_var: str(index)}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "sparrow_cli.main", *args, *extra],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _shards(checkpoint: Path) -> set[str]:
    return {p.name for p in (checkpoint / "state").glob("*.distcp")}


@pytest.mark.slow
def test_two_nodes_train_a_killed_node_ends_the_other_and_both_resume(tmp_path):
    """Steps complete over 2 nodes (world size 2 on rank 0's metrics) and each node writes its shards of every
    checkpoint; SIGKILL to node 1's launcher (its rank dies with it) ends node 0 non-zero within the collective
    timeout; both started again resume from the checkpoint and finish 2 more steps, no group trained twice."""
    run_dir, config = tmp_path / "run", tmp_path / "trainer.toml"
    logs = [tmp_path / "node-0.log", tmp_path / "node-1.log"]
    nodes: list[subprocess.Popen] = []
    with redis_server() as redis:
        port, metrics_port = free_port(), free_port()
        _write_config(config, run_dir, redis.url, port, metrics_port)
        args, rank_var = _chart_command(config, free_port())
        node1 = _node(args, rank_var, 1, logs[1])  # first: it waits for node 0 at the rendezvous
        nodes = [_node(args, rank_var, 0, logs[0]), node1]
        generator = SamplingGenerator(redis.url, f"127.0.0.1:{port}", follow_policy=True, work_dir=tmp_path).start()
        try:
            wait_until(lambda: len(_steps(run_dir)) >= 2, 300, "2 steps on 2 nodes")
            import urllib.request

            metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            assert "sparrow_trainer_world_size 2.0" in metrics
            newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
            assert _shards(newest) == {"__0_0.distcp", "__1_0.distcp"}, _shards(newest)  # one per node's rank
            assert all(n.poll() is None for n in nodes), logs[0].read_text()[-3000:]
            nodes[1].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            code = nodes[0].wait(TIMEOUT_S + 60)  # the collective timeout, then the agent's look at its rank
            ended_after = time.monotonic() - killed
            nodes[1].wait(10)
            at_kill = _newest(run_dir)
            assert code not in (0, None) and at_kill is not None and at_kill.step >= 2
            # Both pods again (a JobSet restart): the same arguments, 2 more steps than the checkpoint holds.
            steps = str(at_kill.step + 2)
            nodes = [_node(args, rank_var, i, logs[i], "--steps", steps) for i in (0, 1)]
            assert nodes[0].wait(300) == 0, f"{generator.describe()}\n{logs[0].read_text()[-4000:]}"
            assert nodes[1].wait(60) == 0, logs[1].read_text()[-4000:]
        finally:
            generator.close()
            for n in nodes:
                if n.poll() is None:
                    n.kill()
    assert ended_after < TIMEOUT_S + 60
    final = _newest(run_dir)
    trained = [gid for step in final.history for gid in step]
    assert final.step == at_kill.step + 2 and len(trained) == len(set(trained)) == final.step * GROUPS_PER_STEP
    assert final.history[: at_kill.step] == at_kill.history
    versions = [r["published_version"] for r in _steps(run_dir)]
    assert versions == sorted(set(versions)), versions  # each version once, rising across the crash
    assert _shards(sorted((run_dir / "checkpoints").glob("step-*"))[-1]) == {"__0_0.distcp", "__1_0.distcp"}
    node0, node1 = (log.read_text() for log in logs)
    assert node0.count("starting 1 trainer process(es) (node 0 of 2, 2 in all)") == 2
    assert node1.count("rank 1 of 2 follows rank 0") == 2 and "rank 1 stops after 2 step(s)" in node1
    assert "resumed from step-" in node0


def test_a_node_waiting_for_node_0_stops_on_sigterm_without_waiting_out_the_rendezvous(tmp_path):
    """Node 1 alone waits for node 0 inside the rendezvous's C++ retries (join_timeout_s 600 s), where the main thread
    runs no Python signal handler; SIGTERM still ends it at once, exit 0, since no rank holds anything to save."""
    log = tmp_path / "node-1.log"
    args, rank_var = _chart_command(tmp_path / "trainer.toml", free_port())
    (tmp_path / "trainer.toml").write_text(f'run_dir = "{tmp_path / "run"}"\n')
    node = _node(args, rank_var, 1, log)
    try:
        wait_until(lambda: "starting 1 trainer process(es) (node 1 of 2" in log.read_text(), 120, "the launch")
        node.send_signal(signal.SIGTERM)
        assert node.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if node.poll() is None:
            node.kill()
    assert "SIGTERM before the trainer processes started: stopping" in log.read_text()
