"""What the adapter-push tests share: the trainer's real WeightService on loopback, and a generator-side
VersionSync (version_sync) that fetches, verifies and loads adapters into an engine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from services.api.sparrow.v1 import weights_pb2_grpc
from services.common.aio_server import AioServer
from services.common.grpc_server import GrpcSecurity
from services.generator.engine import FinishedSample
from services.generator.metrics import GeneratorMetrics
from services.generator.version_sync import VersionSync
from services.generator.weight_fetch import ADAPTER, WeightFetcher
from services.trainer.weight_servicer import WeightServicer
from services.trainer.weights import WeightStore
from trainer.batch import Rollout


@contextmanager
def weight_service(root: Path) -> Iterator[tuple[WeightStore, str]]:
    """The trainer's WeightStore served by its WeightServicer on a free loopback port: (store, address)."""
    store = WeightStore(root, keep=8)
    server = AioServer(GrpcSecurity(), max_calls=64)
    weights_pb2_grpc.add_WeightServiceServicer_to_server(WeightServicer(store, 1 << 14, 1 << 20), server.server)
    port = server.bind("127.0.0.1:0")
    server.start()
    try:
        yield store, f"127.0.0.1:{port}"
    finally:
        store.close()
        server.stop(0)


def version_sync(engine, address: str, folder: Path, in_use: bool = True) -> tuple[VersionSync, GeneratorMetrics]:
    """The generator's fetch-verify-load path onto `engine`, driven with `load_now` from the test's thread.

    `in_use`: replaced adapter folders stay while the engine's sequences use them, as in the service.
    """
    metrics = GeneratorMetrics()

    def load(kind: str, path: Path, version: int):
        if kind == ADAPTER:
            engine.load_adapter(path, version)
        else:
            engine.load_policy(path, version)
        return engine.versions

    fetcher = WeightFetcher(address, GrpcSecurity(), folder, chunk_bytes=1 << 14)
    keep = engine.adapter_folders_in_use if in_use else None
    return VersionSync(fetcher, load, lambda: engine.versions, metrics, keep), metrics


def as_rollouts(samples: list[FinishedSample]) -> list[Rollout]:
    """Finished samples as the trainer sees them."""
    return [
        Rollout(
            group_id=s.group_id,
            sample_index=s.sample_index,
            prompt_ids=tuple(s.prompt_token_ids),
            token_ids=tuple(s.token_ids),
            logprobs=tuple(s.logprobs),
            top_ids=tuple(tuple(t) for t in s.top_token_ids),
            top_logprobs=tuple(tuple(t) for t in s.top_logprobs),
            kv_budgets=tuple(s.kv_budgets),
        )
        for s in samples
    ]


def max_diff(rows: list[torch.Tensor], samples: list[FinishedSample]) -> float:
    """Largest |trainer - engine| logprob over every token of the samples."""
    return max(float((r - torch.tensor(s.logprobs)).abs().max()) for r, s in zip(rows, samples, strict=True))


def swaps(metrics: GeneratorMetrics, outcome: str) -> float:
    """sparrow_generator_swaps_total{kind="adapter", outcome=...}."""
    value = metrics.registry.get_sample_value("sparrow_generator_swaps_total", {"kind": "adapter", "outcome": outcome})
    return value or 0.0
