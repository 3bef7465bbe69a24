"""A generator's whole weight path with a stand-in engine, for `sparrow bench weights` and its tests.

`StandinGenerator` is a generator minus vLLM: the real VersionWatcher, VersionSync, WeightFetcher,
PolicySource and relay server, with an engine side that loads each version's tensors into torch
tensors (copies, resident like an engine's weights) and records their digest. `run_process` runs
one in a process of its own and sends one record per version it serves to its parent.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

from bench import rss
from services.common.grpc_server import GrpcSecurity
from services.generator.engine import EngineVersions
from services.generator.policy_relay import HeldPolicy, RelayServer
from services.generator.policy_source import PolicySource
from services.generator.version_sync import VersionSync, VersionWatcher
from services.generator.weight_checks import check_policy, check_policy_names
from services.generator.weight_fetch import WeightFetcher
from sparrow.weight_delta import folder_tensors, tensors_digest


class StandinGenerator:
    """The weight path of one generator on loopback; `loaded` maps each served version to its digest."""

    def __init__(
        self,
        trainer: str,
        root: Path,
        generator_id: str,
        relay: bool = True,
        digest_checked: bool = True,
        security: GrpcSecurity | None = None,
        chunk_bytes: int = 4 << 20,
        peer_timeout_s: float = 120.0,
        on_loaded=None,
        metrics=None,
        stream: bool = False,
    ) -> None:
        self.generator_id = generator_id
        security = security or GrpcSecurity()
        self.fetcher = WeightFetcher(trainer, security, Path(root), chunk_bytes)
        self.held = HeldPolicy()
        self.relay = RelayServer(self.held, security, "127.0.0.1:0", 120.0) if relay else None
        address = f"127.0.0.1:{self.relay.port}" if self.relay else ""
        source = None
        if digest_checked:
            source = PolicySource(self.fetcher, generator_id, self.held, address, peer_timeout_s, metrics)
        self.weights: dict = {}
        self.version = 0
        self.loaded: dict[int, str] = {}
        self.refused: list[str] = []
        self.on_loaded = on_loaded
        self._lock = threading.Lock()
        # Streamed (without a relay): versions go from the stream into host memory and are loaded from there.
        streamed = self._load_tensors if stream and source is None else None
        self.sync = VersionSync(self.fetcher, self._load, self._serving, metrics, None, source, streamed)
        self.watch = VersionWatcher(trainer, security, generator_id, self.sync.offer)

    @property
    def relay_address(self) -> str:
        return f"127.0.0.1:{self.relay.port}" if self.relay else ""

    def _serving(self) -> EngineVersions:
        return EngineVersions(policy_version=self.version)

    def _load(self, kind: str, folder: Path, version: int) -> EngineVersions:
        # The engine side: today's host checks (names, shapes, finiteness), then copies into torch tensors.
        check_policy(folder, {n: tuple(t.shape) for n, t in self.weights.items()}, version)
        return self._serve({name: t.clone() for name, t in folder_tensors(folder)}, version)

    def _load_tensors(self, tensors: dict, version: int) -> EngineVersions:
        # Streamed: names and shapes again (finiteness and sha256 were checked on arrival), then the engine's copy.
        if self.weights:
            check_policy_names(tensors, {n: tuple(t.shape) for n, t in self.weights.items()}, version)
        return self._serve({name: t.clone() for name, t in tensors.items()}, version)

    def _serve(self, weights: dict, version: int) -> EngineVersions:
        digest = tensors_digest((n, weights[n]) for n in sorted(weights))
        with self._lock:
            self.weights, self.version = weights, version
            self.loaded[version] = digest
        if self.on_loaded is not None:
            self.on_loaded(version, digest)
        return self._serving()

    def start(self) -> StandinGenerator:
        if self.relay is not None:
            self.relay.start()
        self.sync.start()
        self.watch.start()
        return self

    def close(self) -> None:
        self.watch.close()
        self.sync.close()
        if self.relay is not None:
            self.relay.stop(0.5)


def run_process(
    trainer: str, root: str, generator_id: str, relay: bool, digest_checked: bool, stream: bool, conn
) -> None:
    """A stand-in generator process: one dict per served version to `conn` (a multiprocessing connection), until
    it sends None or closes."""
    rss.reset_peak()  # this generator's own peak, not its parent's
    import torch

    torch.set_num_threads(1)

    def report(version: int, digest: str) -> None:
        line = {"generator": generator_id, "version": version, "digest": digest, "t": time.time()}
        conn.send({**line, "peak_rss_bytes": rss.peak_bytes()})

    gen = StandinGenerator(trainer, Path(root), generator_id, relay, digest_checked, on_loaded=report, stream=stream)
    gen.start()
    conn.send({"generator": generator_id, "ready": True, "relay": gen.relay_address})
    with contextlib.suppress(EOFError):
        conn.recv()
    gen.close()


class PublishingTrainer:
    """The trainer's weight side on loopback: WeightStore, digests and deltas, the source plan, its WeightService.

    Counts the bytes of every chunk its WeightService sends (`sent`), by kind (full, delta)."""

    def __init__(
        self,
        run_dir: Path,
        deltas: bool = True,
        trainer_fanout: int = 2,
        peer_fanout: int = 2,
        keep: int = 3,
        security: GrpcSecurity | None = None,
    ) -> None:
        from services.api.sparrow.v1 import weights_pb2_grpc
        from services.common.aio_server import AioServer
        from services.trainer.policy_sources import SourcePlanner
        from services.trainer.policy_sync import PolicySyncStore
        from services.trainer.weights import WeightStore

        security = security or GrpcSecurity()
        self.store = WeightStore(run_dir, keep)
        self.sync = PolicySyncStore(run_dir, deltas)
        self.planner = SourcePlanner(trainer_fanout, peer_fanout, keep + 1)
        self.sent = {"full": 0, "delta": 0}
        self._lock = threading.Lock()
        self.servicer = _counting_servicer(self)
        # The trainer's own server kind (asyncio; its WeightService is async).
        self.server = AioServer(security, max_calls=1024, max_message_bytes=64 << 20, name="bench-trainer")
        weights_pb2_grpc.add_WeightServiceServicer_to_server(self.servicer, self.server.server)
        self.port = self.server.bind("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def count(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.sent[kind] += nbytes

    def publish(self, version: int, state: dict, dtype: str, side_files: dict[str, str]) -> str:
        """Publish `state` (already in `dtype`) as `version`, with `side_files` (name -> text); returns its digest."""
        from safetensors.torch import save_file

        from services.trainer.policy_sync import publish_policy

        def write(out: Path) -> None:
            save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
            for name, text in side_files.items():
                (out / name).write_text(text)

        publish_policy(self.store, self.sync, version, write, dtype)
        return self.sync.record(version).result_sha256

    def close(self) -> None:
        self.store.close()
        self.server.stop(0.5)


def _counting_servicer(trainer: PublishingTrainer):
    from services.trainer.sync_servicer import TrainerWeightServicer

    class Counting(TrainerWeightServicer):
        async def FetchPolicy(self, request, context):
            async for chunk in super().FetchPolicy(request, context):
                trainer.count("full", len(chunk.chunk.data))
                yield chunk

        async def FetchPolicyDelta(self, request, context):
            async for chunk in super().FetchPolicyDelta(request, context):
                trainer.count("delta", len(chunk.chunk.data))
                yield chunk

    return Counting(trainer.store, 1 << 20, 4 << 20, trainer.sync, trainer.planner)
