"""The trainer publishes versions in the serving dtype, with the digest of their tensors and a delta."""

import json
from pathlib import Path

import pytest
import torch

from services.generator.weight_checks import check_policy, checkpoint_layout
from services.trainer.config import TrainerServiceConfig
from services.trainer.service import TrainerService
from sparrow.config import load_config
from sparrow.weight_delta import DELTA_FILE, apply_delta, folder_digest, folder_tensors
from trainer.hf_checkpoint import INDEX_NAME
from trainer.model_io import load_model

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny"


def _service(tmp_path, **weights):
    overrides = {"run_dir": str(tmp_path), "model_dir": str(TINY), "redis.url": "redis://127.0.0.1:1/0"}
    overrides |= {f"weights.{k}": v for k, v in weights.items()}
    return TrainerService(load_config(TrainerServiceConfig, overrides=overrides))  # Redis is not touched here


def test_versions_go_out_in_bf16_with_their_digest_and_a_delta_that_rebuilds_them(tmp_path):
    service = _service(tmp_path, dtype="bfloat16")
    v1 = service.weights.folder("policy", 1)
    assert {t.dtype for _, t in folder_tensors(v1)} == {torch.bfloat16}
    assert json.loads((v1 / "config.json").read_text())["dtype"] == "bfloat16"
    assert service.sync.record(1).result_sha256 == folder_digest(v1)
    assert next(p.dtype for p in service.model.parameters()) == torch.float32  # the master weights stay fp32
    with torch.no_grad():
        next(service.model.parameters()).add_(1e-2)
    service.publish(2)
    record, v2 = service.sync.record(2), service.weights.folder("policy", 2)
    assert record.delta_base_version == 1 and 0 < record.delta_bytes < record.full_bytes / 4
    digest = apply_delta(v1, service.sync.delta_folder(2) / DELTA_FILE, tmp_path / "rebuilt", record.result_sha256)
    assert digest == folder_digest(v2) == record.result_sha256


def test_an_fp32_model_goes_out_in_fp32_and_a_delta_larger_than_the_weights_is_not_kept(tmp_path):
    service = _service(tmp_path)  # auto: the tiny model's config says float32
    assert {t.dtype for _, t in folder_tensors(service.weights.folder("policy", 1))} == {torch.float32}
    with torch.no_grad():
        for p in service.model.parameters():
            p.add_(1e-6 * torch.sign(torch.randn_like(p)))  # every fp32 element moves
    service.publish(2)
    record = service.sync.record(2)
    assert record.delta_base_version == 0 and not service.sync.delta_folder(2).exists()
    assert record.result_sha256 == folder_digest(service.weights.folder("policy", 2))


def test_records_follow_the_published_versions(tmp_path):
    service = _service(tmp_path, dtype="bfloat16", keep=2)
    for v in (2, 3, 4):
        service.publish(v)
    assert service.sync.record(1) is service.sync.record(2) is None
    assert service.sync.record(3) is not None and service.sync.record(4).delta_base_version == 3


def test_a_version_over_several_files_has_its_index_digest_and_delta_and_fits_the_model_it_came_from(tmp_path):
    """Proves: with a small `weights.max_shard_bytes` a version is several files and an index that loads back
    as the trainer's model in bf16; its digest and its delta (file by file) rebuild it; and its tensors are the
    model folder's, so a generator started from that folder takes it (the tied head goes out once, in bf16 too)."""
    service = _service(tmp_path, dtype="bfloat16", max_shard_bytes=20_000)
    v1 = service.weights.folder("policy", 1)
    files = sorted(p.name for p in v1.glob("*.safetensors"))
    assert len(files) > 3 and (v1 / INDEX_NAME).is_file() and not (v1 / "model.safetensors").exists()
    check_policy(v1, checkpoint_layout(TINY), 1)
    with torch.no_grad():
        service.model.model.norm.weight.add_(0.5)  # one tensor moves: the delta names one file's tensor
    service.publish(2)
    v2, record = service.weights.folder("policy", 2), service.sync.record(2)
    assert sorted(p.name for p in v2.glob("*.safetensors")) == files
    assert record.result_sha256 == folder_digest(v2) and record.delta_base_version == 1
    rebuilt, delta = tmp_path / "rebuilt", service.sync.delta_folder(2) / DELTA_FILE
    assert apply_delta(v1, delta, rebuilt, record.result_sha256) == folder_digest(v2)
    held = {n: p.detach().to(torch.bfloat16).float() for n, p in service.model.state_dict().items()}
    assert all(torch.equal(t, held[n]) for n, t in load_model(rebuilt).state_dict().items())


@pytest.mark.parametrize("bad", ["int8", "fp8"])
def test_an_unknown_dtype_is_refused_by_the_config(tmp_path, bad):
    with pytest.raises(ValueError, match="weights.dtype"):
        _service(tmp_path, dtype=bad)
