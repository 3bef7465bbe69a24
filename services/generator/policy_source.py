"""Fetching a policy version the fleet way: the trainer names the digest and the sources, peers send bytes.

For each version the generator asks the trainer (GetPolicySource) for the digest the version's
tensors must have and the sources to try: a peer relay (or the trainer itself), then the trainer.
From each source it takes the delta when it holds the delta's base, else the full version; a delta
whose result fails the digest, or that the source lacks, is followed by the full version; a source
that fails, answers slowly (its own deadline) or sends other weights than the trainer's digest is
dropped (the trainer is told, and names another); the trainer itself is always tried last. Nothing
unchecked is ever handed on: the result's digest is the trainer's, whoever sent the bytes.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.api.sparrow.v1 import weights_pb2, weights_pb2_grpc
from services.common.grpc_server import open_channel
from services.generator.metrics import GeneratorMetrics
from services.generator.policy_relay import HeldPolicy
from services.generator.weight_fetch import (
    POLICY,
    POLICY_DELTA,
    Fetched,
    WeightFetcher,
    WeightFetchError,
    WeightsUnavailable,
)
from sparrow.weight_delta import DELTA_FILE, DeltaError, apply_delta, folder_digest

log = logging.getLogger("sparrow.generator.weights")

_ROUNDS = 3  # asks of the trainer for another peer before going to the trainer itself


@dataclass(frozen=True)
class PolicyFetched:
    """A verified policy version: the folder to load, and the delta it was built from (None: fetched whole)."""

    fetched: Fetched
    source: str  # "" the trainer, else the peer's address
    kind: str  # "full" or "delta"
    delta_folder: Path | None = None
    delta_base: int = 0
    nbytes: int = 0  # bytes that came over the wire
    published_unix_s: float = 0.0  # when the trainer published it


class PolicySource:
    """Fetches policy versions through the trainer's source plan; holds nothing itself (see HeldPolicy)."""

    def __init__(
        self,
        fetcher: WeightFetcher,
        generator_id: str,
        held: HeldPolicy,
        relay_address: str = "",
        peer_timeout_s: float = 120.0,
        metrics: GeneratorMetrics | None = None,
    ) -> None:
        self.fetcher, self.generator_id, self.held = fetcher, generator_id, held
        self.relay_address, self.peer_timeout_s = relay_address, peer_timeout_s
        self.metrics = metrics

    def _failed(self, exc: BaseException) -> None:
        if self.metrics is None:
            return
        if isinstance(exc, DeltaError):
            reason = "digest" if "digest" in str(exc) else "delta"
        elif isinstance(exc, WeightsUnavailable):
            reason = "unavailable"
        else:
            reason = "digest" if "digest" in str(exc) else "refused"
        self.metrics.policy_fetch_failures.labels(reason=reason).inc()

    def _got(self, got: PolicyFetched) -> PolicyFetched:
        if self.metrics is not None:
            source = "peer" if got.source else "trainer"
            self.metrics.policy_fetch_bytes.labels(kind=got.kind, source=source).inc(got.nbytes)
        return got

    def _ask(self, version: int, held_version: int, failed: list[str]) -> weights_pb2.GetPolicySourceResponse:
        channel = open_channel(self.fetcher.address, self.fetcher.security)
        try:
            request = weights_pb2.GetPolicySourceRequest(
                generator_id=self.generator_id,
                version=version,
                held_version=held_version,
                relay_address=self.relay_address,
                failed_sources=failed,
            )
            return weights_pb2_grpc.WeightServiceStub(channel).GetPolicySource(request, timeout=30)
        except grpc.RpcError as exc:
            raise WeightsUnavailable(
                f"cannot ask {self.fetcher.address} for policy v{version}'s source: {exc.code().name} {exc.details()}",
                exc.code(),
            ) from None
        finally:
            channel.close()

    def report_held(self, version: int) -> None:
        """Tell the trainer this generator holds `version` (verified) and relays it; failures only logged."""
        try:
            self._ask(version, version, [])
        except WeightsUnavailable as exc:
            log.warning("%s", exc)

    def fetch(self, version: int, held_folder: Path | None, held_version: int) -> PolicyFetched:
        """Fetch and verify `version`; `held_folder` holds `held_version` (the base a delta may apply to)."""
        self.held.fetching(version)  # before asking: the trainer may name this generator a source at once
        try:
            failed: list[str] = []
            tried: set[str] = set()
            answer = None
            for _ in range(_ROUNDS):
                answer = self._ask(version, held_version, failed)
                peers = [s for s in answer.sources if s and s not in tried]
                if not peers:
                    break
                for peer in peers:
                    tried.add(peer)
                    try:
                        return self._got(self._from(peer, answer, held_folder, held_version))
                    except WeightFetchError as exc:
                        self._failed(exc)
                        log.warning("peer %s dropped for policy v%d: %s", peer, version, exc)
                        failed.append(peer)
            try:
                return self._got(self._from("", answer, held_folder, held_version))
            except WeightFetchError as exc:
                self._failed(exc)
                raise
        except BaseException:
            self.held.gave_up(version)
            raise

    def _from(
        self, source: str, answer: weights_pb2.GetPolicySourceResponse, held_folder: Path | None, held_version: int
    ) -> PolicyFetched:
        version, timeout = answer.version, self.peer_timeout_s if source else 0.0
        base = answer.delta_base_version
        if base and held_folder is not None and held_version == base:
            try:
                return self._delta(source, answer, held_folder, timeout)
            except (WeightFetchError, DeltaError) as exc:
                self._failed(exc)
                where = source or "the trainer"
                log.warning("policy v%d delta from %s refused (%s); fetching it whole", version, where, exc)
        fetched = self.fetcher.fetch(POLICY, version, source, timeout_s=timeout)
        digest = folder_digest(fetched.folder)
        if digest != answer.result_sha256:
            shutil.rmtree(fetched.folder, ignore_errors=True)
            raise WeightFetchError(
                f"policy v{version} from {source or 'the trainer'} refused: its tensors' digest {digest[:16]}... is "
                f"not the trainer's {answer.result_sha256[:16]}... (other weights than the version's)"
            )
        nbytes = sum(f.size_bytes for f in fetched.manifest.files)
        return PolicyFetched(fetched, source, "full", nbytes=nbytes, published_unix_s=answer.published_unix_seconds)

    def _delta(
        self, source: str, answer: weights_pb2.GetPolicySourceResponse, held_folder: Path, timeout: float
    ) -> PolicyFetched:
        version, base = answer.version, answer.delta_base_version
        delta = self.fetcher.fetch(POLICY_DELTA, version, source, base_version=base, timeout_s=timeout)
        self.held.delta_arrived(version, delta.folder, base)  # peers may take it on while it is applied here
        out = self.fetcher.root / f".policy-v{version}-from-delta"
        shutil.rmtree(out, ignore_errors=True)
        try:
            if [f.path for f in delta.manifest.files] != [DELTA_FILE]:
                raise DeltaError(f"a delta holds one file, {DELTA_FILE}; got {[f.path for f in delta.manifest.files]}")
            apply_delta(held_folder, delta.folder / DELTA_FILE, out, answer.result_sha256)
            final = self.fetcher.root / f"{POLICY}-v{version}"
            shutil.rmtree(final, ignore_errors=True)
            out.rename(final)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(delta.folder, ignore_errors=True)
            raise
        nbytes = sum(f.size_bytes for f in delta.manifest.files)
        manifest = weights_pb2.WeightManifest(version=version)
        fetched = Fetched(POLICY, version, final, manifest)
        return PolicyFetched(fetched, source, "delta", delta.folder, base, nbytes, answer.published_unix_seconds)
