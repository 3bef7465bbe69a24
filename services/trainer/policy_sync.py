"""What the trainer keeps beside each published policy version so generators can sync it cheaply.

    run_dir/policy-sync/v00000003.json     {"version", "result_sha256", "delta": {"base_version", "bytes"} | null}
    run_dir/policy-sync/v00000003/policy.delta

`prepare` runs while a version is written (inside `WeightStore.publish`, before the version is
visible): it computes the digest of the version's tensors and, when the previous version has the same
layout, a delta against it, kept only when under half the full weights (in fp32 an Adam step moves
every element, and the delta is about as large). The record is written before the version exists, so a
generator told of a version always finds its digest. Records follow the store's `keep`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from services.common.faults import fault_point
from services.trainer.store import replace_text
from services.trainer.weights import POLICY, Manifest, WeightStore
from sparrow.weight_delta import DELTA_FILE, folder_digest, weight_files, write_delta

log = logging.getLogger("sparrow.trainer.weights")

SYNC_DIR = "policy-sync"
# A delta that saves less than half the bytes is not worth its rebuild (an fp32 step moves every element).
DELTA_KEPT_BELOW = 0.5
_RECORD = re.compile(r"^v(\d{8,})(\.json)?$")


@dataclass(frozen=True)
class SyncRecord:
    """A version's result digest and, if one was kept, the version its delta applies to (0: none)."""

    version: int
    result_sha256: str
    delta_base_version: int = 0
    delta_bytes: int = 0
    full_bytes: int = 0
    published_unix_s: float = 0.0


def publish_policy(
    weights: WeightStore, sync: PolicySyncStore, version: int, write: Callable[[Path], None], dtype: str
) -> Manifest:
    """Publish policy `version` (`write(folder)` saves the serving-dtype weights): the config declares `dtype`,
    the digest and the delta against the latest version are ready before the version becomes visible."""
    previous = weights.latest(POLICY)
    base = weights.folder(POLICY, previous) if previous else None

    def write_all(out: Path) -> None:
        write(out)
        fault_point("trainer:publish")
        set_config_dtype(out, dtype)
        sync.prepare(version, out, base, previous)

    manifest = weights.publish(POLICY, version, write_all)
    sync.retire(lambda v: weights.has(POLICY, v))
    return manifest


def set_config_dtype(folder: Path, dtype: str) -> None:
    """Make the saved config.json declare `dtype`, so an engine loading with dtype "auto" serves that dtype."""
    path = folder / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    path.write_text(json.dumps(config, indent=2) + "\n")


class PolicySyncStore:
    """Digests and deltas of published policy versions under `run_dir/policy-sync`."""

    def __init__(self, run_dir: str | Path, deltas: bool = True) -> None:
        self.root = Path(run_dir) / SYNC_DIR
        self.root.mkdir(parents=True, exist_ok=True)
        self.deltas = deltas
        for path in self.root.glob(".tmp-*"):
            shutil.rmtree(path, ignore_errors=True)

    def _record_path(self, version: int) -> Path:
        return self.root / f"v{version:08d}.json"

    def delta_folder(self, version: int) -> Path:
        """The folder holding the delta file of `version`."""
        return self.root / f"v{version:08d}"

    def prepare(self, version: int, folder: Path, base: Path | None, base_version: int) -> SyncRecord:
        """Digest `folder` (version `version`, being published) and write its delta against `base` (if any)."""
        digest = folder_digest(folder)
        full = sum(f.stat().st_size for f in weight_files(folder))
        delta_base = delta_bytes = 0
        final = self.delta_folder(version)
        shutil.rmtree(final, ignore_errors=True)  # a version number reused after a crash
        if self.deltas and base is not None and base.is_dir():
            tmp = self.root / f".tmp-v{version:08d}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                stats = write_delta(base, folder, tmp / DELTA_FILE, base_version, version, digest)
            except Exception as exc:  # noqa: BLE001 -- a damaged base on disk costs the delta, never the publish
                log.warning("policy v%d: no delta, base v%d unreadable (%s)", version, base_version, exc)
                stats = None
            if stats is not None and stats.delta_bytes < DELTA_KEPT_BELOW * full:
                tmp.rename(final)
                delta_base, delta_bytes = base_version, stats.delta_bytes
                log.info(
                    "policy v%d: delta against v%d is %d bytes (%.2f%% of %d; %.3f%% of elements changed)",
                    version, base_version, delta_bytes, 100 * delta_bytes / max(full, 1), full,
                    100 * stats.changed / max(stats.elements, 1),
                )  # fmt: skip
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        record = SyncRecord(version, digest, delta_base, delta_bytes, full, time.time())
        replace_text(self._record_path(version), json.dumps(record.__dict__) + "\n")
        return record

    def record(self, version: int) -> SyncRecord | None:
        """The record of `version`, or None when there is none (not published, or retired)."""
        try:
            d = json.loads(self._record_path(version).read_text())
            types = {f.name: f.type for f in fields(SyncRecord)}
            cast = {"int": int, "str": str, "float": float}
            return SyncRecord(**{k: cast[types[k]](v) for k, v in d.items()})
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def retire(self, published: Callable[[int], bool]) -> None:
        """Drop the records and deltas of every version for which `published(version)` is false (retired)."""
        for path in self.root.iterdir():
            m = _RECORD.match(path.name)
            if m and not published(int(m.group(1))):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
