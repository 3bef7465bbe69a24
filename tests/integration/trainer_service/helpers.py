"""What the trainer-service tests share: real samples from the tiny model, a RolloutService client session,
a policy fetcher that checks sha256, and a sampling generator that works the Redis Stream like the real one.

The generator here is the project's reference sampler (trainer/reference_generate.py) behind the real
work contract and the real gRPC API: no vLLM, no mocks.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from pathlib import Path

import grpc
import redis

from services.api.sparrow.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, weights_pb2, weights_pb2_grpc
from services.common.grpc_server import GrpcSecurity, open_channel
from sparrow.tasks.vocab import EOS, TOKEN_TO_ID
from sparrow.work import GENERATOR_GROUP, PROMPTS_STREAM, PromptGroup
from trainer.reference_generate import generate

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "models" / "tiny"
log = logging.getLogger("tests.generator")


def sample_trajectories(
    model,
    group_id: str,
    prompt: tuple[int, ...] | list[int],
    n: int,
    policy_version: int,
    max_new_tokens: int = 16,
    seed: int = 0,
    temperature: float = 1.0,
    schedule_version: int = 0,
    generator_id: str = "test-gen",
) -> list[rollout_pb2.Trajectory]:
    """`n` samples of one prompt from `model` by the reference sampler, as wire trajectories (ids stable per slot)."""
    gens = generate(model, [list(prompt)] * n, None, max_new_tokens, temperature, seed=seed, eos_id=TOKEN_TO_ID[EOS])
    out = []
    for i, g in enumerate(gens):
        tops = [
            rollout_pb2.TopLogprobs(token_ids=ids, logprobs=lps)
            for ids, lps in zip(g.scores.top_ids.tolist(), g.scores.top_logprobs.tolist(), strict=True)
        ]
        out.append(
            rollout_pb2.Trajectory(
                trajectory_id=f"{group_id}/{i}",
                group_id=group_id,
                sample_index=i,
                prompt_token_ids=list(prompt),
                token_ids=g.tokens,
                logprobs=g.scores.logprobs.tolist(),
                top_logprobs=tops,
                kv_budgets=[0] * len(g.tokens),
                versions=common_pb2.Versions(policy_version=policy_version, schedule_version=schedule_version),
                finish_reason=rollout_pb2.FINISH_REASON_STOP if g.finished else rollout_pb2.FINISH_REASON_LENGTH,
                generator_id=generator_id,
            )
        )
    return out


class RolloutSession:
    """One trajectory stream: the hello is exchanged on open, then `send` returns each trajectory's ack."""

    def __init__(self, channel: grpc.Channel, generator_id: str = "test-gen", timeout: float | None = None) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(
            rollout_pb2.StreamTrajectoriesRequest(hello=rollout_pb2.GeneratorHello(generator_id=generator_id))
        )
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        self._responses = stub.StreamTrajectories(iter(self._requests.get, None), timeout=timeout)
        self.hello = next(self._responses).hello

    def send(self, t: rollout_pb2.Trajectory) -> rollout_pb2.TrajectoryAck:
        self._requests.put(rollout_pb2.StreamTrajectoriesRequest(trajectory=t))
        return next(self._responses).ack

    def send_raw(self, request: rollout_pb2.StreamTrajectoriesRequest) -> rollout_pb2.StreamTrajectoriesResponse:
        self._requests.put(request)
        return next(self._responses)

    def receive(self) -> rollout_pb2.StreamTrajectoriesResponse:
        """The server's next message, sent unasked (or the RpcError it ends the stream with)."""
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)
        for _ in self._responses:  # let the server end the stream
            pass


def fetch_policy(channel: grpc.Channel, out: Path, version: int = 0, chunk_bytes: int = 0) -> tuple[int, int]:
    """Download a policy version into `out`, refusing any file whose size or sha256 differs from the manifest.

    Returns (version, chunks received).
    """
    stub = weights_pb2_grpc.WeightServiceStub(channel)
    stream = stub.FetchPolicy(weights_pb2.FetchPolicyRequest(version=version, chunk_bytes=chunk_bytes), timeout=60)
    manifest = next(stream).manifest
    out.mkdir(parents=True, exist_ok=True)
    digests = {f.path: hashlib.sha256() for f in manifest.files}
    handles = {}
    chunks = 0
    for message in stream:
        c = message.chunk
        if c.path not in handles:
            (out / c.path).parent.mkdir(parents=True, exist_ok=True)
            handles[c.path] = (out / c.path).open("wb")
        assert handles[c.path].tell() == c.offset, f"{c.path}: chunk at {c.offset} out of order"
        handles[c.path].write(c.data)
        digests[c.path].update(c.data)
        chunks += 1
    for h in handles.values():
        h.close()
    for f in manifest.files:
        assert (out / f.path).stat().st_size == f.size_bytes, f"{f.path}: size differs from the manifest"
        assert digests[f.path].hexdigest() == f.sha256, f"{f.path}: sha256 differs from the manifest"
    return manifest.version, chunks


class SamplingGenerator:
    """A generator worker: XREADGROUP a group, sample it, stream it to the trainer, XACK after every ack.

    It reconnects (and resends the group in hand) when the trainer goes away, and with
    `follow_policy` fetches and loads each new policy version before sampling, as a real one does.
    `accepted` maps each group id to the sample indices the trainer acked ACCEPTED, `trajectories` to the
    accepted trajectories themselves. With `probe_budget`, sample 1 of every group is sent as a probe
    sequence decoded at that budget: a label only, this stand-in samples densely.
    """

    def __init__(
        self,
        redis_url: str,
        address: str,
        security: GrpcSecurity | None = None,
        follow_policy: bool = False,
        work_dir: Path | None = None,
        consumer: str = "test-gen",
        probe_budget: int = 0,
    ) -> None:
        from trainer.model_io import load_model

        self.redis = redis.Redis.from_url(redis_url)
        self.address = address
        self.security = security or GrpcSecurity()
        self.follow_policy = follow_policy
        self.work_dir = work_dir
        self.consumer = consumer
        self.probe_budget = probe_budget
        self.model = load_model(TINY)
        self.version = 1  # the starting model is what the trainer publishes as version 1
        self.accepted: dict[str, set[int]] = {}
        self.trajectories: dict[str, list[rollout_pb2.Trajectory]] = {}  # group id -> accepted ones
        self.acks: list[tuple[str, int]] = []  # (trajectory id, status) in order
        self.errors = 0
        self.doing = "starting"  # named by `describe` when a test times out
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> SamplingGenerator:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)

    def describe(self) -> str:
        """What this generator is doing and has done, for a test's timeout message."""
        return (
            f"generator {self.consumer}: {self.doing}; policy v{self.version}; {len(self.acks)} acks "
            f"({len(self.accepted)} groups accepted); {self.errors} stream errors"
        )

    def _run(self) -> None:
        pending = None
        seed = 0
        while not self.stop.is_set():
            try:
                channel = open_channel(self.address, self.security)
                session = RolloutSession(channel, self.consumer)
            except grpc.RpcError:
                self.errors += 1
                time.sleep(0.3)
                continue
            try:
                while not self.stop.is_set():
                    if pending is None:
                        self.doing = "reading the stream"
                        pending = self._next_group()
                        if pending is None:
                            continue
                    entry_id, group = pending
                    self.doing = f"fetching a policy for {group.group_id}"
                    self._maybe_update(channel)
                    self.doing = f"sampling and sending {group.group_id}"
                    seed += 1
                    trajectories = sample_trajectories(
                        self.model, group.group_id, group.prompt_token_ids, group.n, self.version,
                        group.sampling.max_new_tokens, seed=seed, generator_id=self.consumer,
                    )  # fmt: skip
                    for t in trajectories:
                        if self.probe_budget and t.sample_index == 1:
                            t.probe = True
                            t.kv_budgets[:] = [0] + [self.probe_budget] * (len(t.token_ids) - 1)
                        ack = session.send(t)
                        self.acks.append((t.trajectory_id, ack.status))
                        if ack.status == rollout_pb2.ACK_STATUS_ACCEPTED:
                            self.accepted.setdefault(t.group_id, set()).add(t.sample_index)
                            self.trajectories.setdefault(t.group_id, []).append(t)
                    self.redis.xack(PROMPTS_STREAM, GENERATOR_GROUP, entry_id)
                    pending = None
            except grpc.RpcError as exc:
                self.errors += 1
                self.doing = f"reconnecting after {exc.code()}"
                log.info("trainer stream ended (%s); reconnecting", exc.code())
                time.sleep(0.3)
            except Exception as exc:  # a trainer that went away mid-fetch, a Redis blip: retry, as a generator does
                self.errors += 1
                self.doing = f"reconnecting after {type(exc).__name__}: {exc}"
                log.warning("generator round failed (%r); reconnecting", exc)
                time.sleep(0.3)
            finally:
                channel.close()

    def _next_group(self):
        entries = self.redis.xreadgroup(GENERATOR_GROUP, self.consumer, {PROMPTS_STREAM: ">"}, count=1, block=200)
        if not entries:
            return None
        entry_id, fields = entries[0][1][0]
        return entry_id, PromptGroup.from_fields(fields)

    def _maybe_update(self, channel: grpc.Channel) -> None:
        if not self.follow_policy:
            return
        from trainer.model_io import load_model

        stub = weights_pb2_grpc.WeightServiceStub(channel)
        call = stub.WatchVersions(weights_pb2.WatchVersionsRequest(generator_id=self.consumer), timeout=10)
        version = next(call).latest.policy_version
        call.cancel()
        if version > self.version:
            folder = self.work_dir / f"v{version}"
            fetched, _ = fetch_policy(channel, folder, version)
            self.model = load_model(folder)
            self.version = fetched
