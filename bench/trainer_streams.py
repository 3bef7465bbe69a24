"""`sparrow bench trainer-streams`: a fleet of generators' streams held open on one trainer's gRPC server.

The trainer's own server (services/trainer/service.py `build_grpc_server`: the asyncio server, the real
RolloutService and WeightService, the service token, a real store, ledger and weight store on disk)
runs in a child process. This process plays G generators, each holding what a generator holds: a
trajectory stream and a version watch. With all 2G calls open it measures, in one run:

- health: a check every `health_interval_s` from a thread of its own, from before the first stream
  opens to after the last closes (the goal: every one answered, within 1 s);
- the server's threads while every call is open (they do not grow with the calls);
- trajectories: each generator sends `trajectories` valid ones on its stream; every one must be acked
  exactly once, ACCEPTED, and stored (fsync before the ack) -- the server's store count is read back;
- watches: a new policy version is published and every watch must see it.

Output: one JSON object. The generators share `channels` client connections, as separate processes
would each have one; the client is grpc's asyncio one, so this side holds no thread per call either.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench import rss
from services.api.sparrow.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, weights_pb2, weights_pb2_grpc

VOCAB = 151_936  # Qwen3's
TOP_K = 20
PROMPT_TOKENS, RESPONSE_TOKENS = 64, 64


def group_id(generator: int) -> str:
    """The group generator number `generator` fills."""
    return f"bench-group-{generator:05d}"


def trajectory(generator: int, index: int, policy_version: int = 1) -> rollout_pb2.Trajectory:
    """Sample `index` of generator `generator`'s group: a well-formed trajectory of the bench's shape."""
    tokens = [(generator * 7919 + index * 104_729 + i * 31) % (VOCAB - TOP_K) for i in range(RESPONSE_TOKENS)]
    tops = [
        rollout_pb2.TopLogprobs(token_ids=[t + j for j in range(TOP_K)], logprobs=[-0.5 - j for j in range(TOP_K)])
        for t in tokens
    ]
    return rollout_pb2.Trajectory(
        trajectory_id=f"{group_id(generator)}/{index}",
        group_id=group_id(generator),
        sample_index=index,
        prompt_token_ids=prompt(generator),
        token_ids=tokens,
        logprobs=[-0.5] * RESPONSE_TOKENS,
        top_logprobs=tops,
        kv_budgets=[0] * RESPONSE_TOKENS,
        versions=common_pb2.Versions(policy_version=policy_version),
        finish_reason=rollout_pb2.FINISH_REASON_LENGTH,
        generator_id=f"bench-gen-{generator:05d}",
    )


def prompt(generator: int) -> list[int]:
    """The prompt of generator `generator`'s group."""
    return [(generator * 13 + i) % VOCAB for i in range(PROMPT_TOKENS)]


def _write_policy(version: int):
    def write(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(bytes([version]) * 1024)
        (folder / "config.json").write_text("{}")

    return write


def _serve(conn, run_dir: str, generators: int, samples: int, max_calls: int, token: str) -> None:
    """The child process: the trainer's gRPC server over a real store, ledger and weight store in `run_dir`."""
    rss.reset_peak()  # the server's own peak, not its parent's
    from services.trainer.config import TrainerServiceConfig
    from services.trainer.ledger import GroupLedger, GroupRecord
    from services.trainer.metrics import TrainerMetrics
    from services.trainer.service import build_grpc_server
    from services.trainer.store import TrajectoryStore
    from services.trainer.validate import Limits
    from services.trainer.weights import POLICY, WeightStore
    from sparrow.config import load_config

    overrides = {"run_dir": run_dir, "grpc.max_calls": max_calls, "security.token": token}
    config = load_config(TrainerServiceConfig, overrides=overrides)
    root = Path(run_dir)
    store, ledger = TrajectoryStore(root / "trajectories"), GroupLedger(root / "ledger")
    weights = WeightStore(root, keep=2)
    weights.publish(POLICY, 1, _write_policy(1))
    for g in range(generators):
        ledger.add(GroupRecord(g, group_id(g), tuple(prompt(g)), samples, "", 1, RESPONSE_TOKENS))
    metrics = TrainerMetrics(4096, 8)
    server = build_grpc_server(config, store, ledger, weights, Limits(VOCAB, TOP_K), metrics)
    port = server.bind("127.0.0.1:0")
    server.start()
    conn.send(port)
    try:
        while True:
            command = conn.recv()
            if command == "publish":
                weights.publish(POLICY, weights.latest(POLICY) + 1, _write_policy(weights.latest(POLICY) + 1))
                conn.send(weights.latest(POLICY))
            elif command == "stats":
                conn.send(
                    {
                        "threads": threading.active_count(),
                        "open_calls": server.stats.open,
                        "refused_calls": dict(server.stats.refused),
                        "stored": sum(store.count(group_id(g)) for g in range(generators)),
                        "max_rss_bytes": rss.peak_bytes(),
                    }
                )
            else:
                break
    finally:
        weights.close()
        server.stop(1.0)
        store.close()
        ledger.close()
        conn.send("stopped")


class HealthProbe:
    """Checks the server's health every `interval_s` from a thread of its own (a plain, blocking client)."""

    def __init__(self, address: str, interval_s: float) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self._channel = grpc.insecure_channel(address)
        self._stub = health_pb2_grpc.HealthStub(self._channel)
        self._request = health_pb2.HealthCheckRequest()
        self._serving = health_pb2.HealthCheckResponse.SERVING
        self.interval_s = interval_s
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                status = self._stub.Check(self._request, timeout=5.0).status
                if status != self._serving:
                    self.failures.append(f"status {status}")
            except grpc.RpcError as exc:
                self.failures.append(exc.code().name)
            self.latencies.append(time.perf_counter() - start)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()

    def summary(self) -> dict:
        """Checks made, failures, and latency figures in seconds."""
        lat = sorted(self.latencies)
        return {
            "checks": len(lat),
            "failures": len(self.failures),
            "max_s": round(lat[-1], 4) if lat else None,
            "p99_s": round(lat[int(0.99 * (len(lat) - 1))], 4) if lat else None,
            "median_s": round(statistics.median(lat), 4) if lat else None,
        }


class _Generator:
    """What one generator holds open on the trainer: a trajectory stream and a version watch."""

    def __init__(self, number: int, channel: grpc.aio.Channel, metadata: tuple) -> None:
        self.number = number
        self.metadata = metadata
        self.rollouts = rollout_pb2_grpc.RolloutServiceStub(channel)
        self.weights = weights_pb2_grpc.WeightServiceStub(channel)
        self.acks: list[rollout_pb2.TrajectoryAck] = []
        self.stream = self.watch = None

    async def open(self) -> None:
        gid = f"bench-gen-{self.number:05d}"
        self.stream = self.rollouts.StreamTrajectories(metadata=self.metadata)
        await self.stream.write(
            rollout_pb2.StreamTrajectoriesRequest(hello=rollout_pb2.GeneratorHello(generator_id=gid))
        )
        if (await self.stream.read()).WhichOneof("item") != "hello":
            raise RuntimeError(f"{gid}: no hello back")
        self.watch = self.weights.WatchVersions(
            weights_pb2.WatchVersionsRequest(generator_id=gid), metadata=self.metadata
        )
        await self.watch.read()

    async def send(self, count: int) -> None:
        for index in range(count):
            await self.stream.write(rollout_pb2.StreamTrajectoriesRequest(trajectory=trajectory(self.number, index)))
            self.acks.append((await self.stream.read()).ack)

    async def see_version(self, version: int) -> float:
        start = time.perf_counter()
        while (await self.watch.read()).latest.policy_version < version:
            pass
        return time.perf_counter() - start

    async def close(self) -> None:
        await self.stream.done_writing()
        while await self.stream.read() is not grpc.aio.EOF:
            pass
        self.watch.cancel()


async def _drive(address: str, token: str, generators: int, samples: int, channels: int, hold_s: float, conn) -> dict:
    loop = asyncio.get_running_loop()

    def ask(command: str):
        conn.send(command)
        return conn.recv()

    pool = [grpc.aio.insecure_channel(address) for _ in range(channels)]
    metadata = (("authorization", f"Bearer {token}"),)
    gens = [_Generator(i, pool[i % channels], metadata) for i in range(generators)]
    out: dict = {}
    t0 = time.perf_counter()
    await asyncio.gather(*(g.open() for g in gens))
    out["open_seconds"] = round(time.perf_counter() - t0, 3)
    await asyncio.sleep(hold_s)  # every call open and idle, health checked meanwhile
    out["while_open"] = await loop.run_in_executor(None, ask, "stats")
    t0 = time.perf_counter()
    await asyncio.gather(*(g.send(samples) for g in gens))
    seconds = time.perf_counter() - t0
    out["send_seconds"] = round(seconds, 3)
    out["trajectories_per_s"] = round(generators * samples / seconds, 1)
    version = await loop.run_in_executor(None, ask, "publish")
    waits = await asyncio.gather(*(g.see_version(version) for g in gens))
    out["watch_seconds_max"] = round(max(waits), 4)
    await asyncio.gather(*(g.close() for g in gens))
    for channel in pool:
        await channel.close()
    acks = [a for g in gens for a in g.acks]
    ids = [a.trajectory_id for a in acks]
    out["acks"] = {
        "accepted": sum(a.status == rollout_pb2.ACK_STATUS_ACCEPTED for a in acks),
        "duplicate": sum(a.status == rollout_pb2.ACK_STATUS_DUPLICATE for a in acks),
        "rejected": sum(a.status == rollout_pb2.ACK_STATUS_REJECTED for a in acks),
        "distinct_ids": len(set(ids)),
    }
    out["reject_reasons"] = sorted({a.reason for a in acks if a.status == rollout_pb2.ACK_STATUS_REJECTED})[:3]
    return out


def run(
    generators: int = 512,
    trajectories: int = 4,
    channels: int = 16,
    hold_s: float = 5.0,
    health_interval_s: float = 0.1,
    max_calls: int | None = None,
) -> dict:
    """Hold `generators` generators' calls open on one trainer server and measure it; returns the figures."""
    if generators < 1 or trajectories < 1 or channels < 1 or hold_s < 0 or health_interval_s <= 0:
        raise ValueError("generators, trajectories and channels must be >= 1, hold_s >= 0, health_interval_s > 0")
    max_calls = max_calls or 2 * generators + 64
    token = "bench-trainer-streams-token"
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no grpc state forked
    ours, theirs = ctx.Pipe()
    with tempfile.TemporaryDirectory(prefix="sparrow-bench-streams-") as run_dir:
        child = ctx.Process(target=_serve, args=(theirs, run_dir, generators, trajectories, max_calls, token))
        child.start()
        try:
            if not ours.poll(120):
                raise RuntimeError("the trainer server did not start within 120 s")
            address = f"127.0.0.1:{ours.recv()}"
            before = (ours.send("stats"), ours.recv())[1]
            with HealthProbe(address, health_interval_s) as probe:
                time.sleep(min(1.0, hold_s))  # a few checks before anything opens: the idle baseline
                idle = probe.summary()
                figures = asyncio.run(_drive(address, token, generators, trajectories, channels, hold_s, ours))
                final = (ours.send("stats"), ours.recv())[1]
            health = probe.summary()
        finally:
            ours.send("stop")
            ours.poll(60) and ours.recv()
            child.join(60)
            if child.is_alive():
                child.kill()
    sent = generators * trajectories
    acks = figures["acks"]
    exactly_once = acks["accepted"] == sent and acks["distinct_ids"] == sent and final["stored"] == sent
    return {
        "benchmark": "trainer-streams",
        "generators": generators,
        "open_calls": figures["while_open"]["open_calls"],
        "max_calls": max_calls,
        "server_threads": {
            "before_any_call": before["threads"],
            "all_calls_open": figures["while_open"]["threads"],
            "after_every_send": final["threads"],  # the blocking-work pool, grown to its size at most
        },
        "open_seconds": figures["open_seconds"],
        "health": health,
        "health_idle": idle,
        "trajectories": {
            "sent": sent,
            **acks,
            "stored": final["stored"],
            "acked_exactly_once": exactly_once,
            "seconds": figures["send_seconds"],
            "per_s": figures["trajectories_per_s"],
        },
        "reject_reasons": figures["reject_reasons"],
        "watch_seconds_max": figures["watch_seconds_max"],
        "refused_calls": final["refused_calls"],
        "server_max_rss_bytes": final["max_rss_bytes"],
        "goal_met": bool(
            exactly_once
            and health["failures"] == 0
            and health["max_s"] is not None
            and health["max_s"] < 1.0
            and figures["while_open"]["open_calls"] == 2 * generators
        ),
    }
