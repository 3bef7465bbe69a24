"""Reading back what each experiment tracker wrote, with the backend's own reader (or its file format)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """name -> {step: value}, by TensorBoard's event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_images(log_dir: Path) -> list[str]:
    """The image tags of the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    return acc.Tags()["images"]


def mlflow_run(tracking_uri: str, experiment: str):
    """(the MlflowClient, the experiment's only run), by MLflow's client."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id])
    return client, run


def mlflow_series(client, run_id: str, name: str) -> dict[int, float]:
    """{step: value} of one metric."""
    return {m.step: m.value for m in client.get_metric_history(run_id, name)}


def _leveldb_records(data: bytes) -> list[bytes]:
    # The .wandb file is a LevelDB-style log: a 7-byte file header, 32 KiB blocks, each record split into
    # chunks with a (crc32, length, type) header; types 1 full, 2 first, 3 middle, 4 last.
    block, pos, parts, out = 32768, 7, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            break
        parts.append(data[pos : pos + length])
        pos += length
        if kind in (1, 4):
            out.append(b"".join(parts))
            parts = []
    return out


def wandb_offline_run(root: Path) -> tuple[dict, list[dict]]:
    """(the run's config, its history rows) from the offline run's transaction log under root/wandb."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = root.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    config: dict = {}
    rows: list[dict] = []
    for raw in _leveldb_records(data):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = record.history.item
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
    return config, rows
