"""The committed tiny model as a reference engine (one torch thread)."""

import pytest
import torch

from tests.unit.generator.tiny_models import TINY

torch.set_num_threads(1)


@pytest.fixture
def engine():
    from services.generator.reference_engine import ReferenceEngine

    e = ReferenceEngine(TINY, kernel_backend="torch", max_model_len=256, max_lora_rank=8)
    yield e
    e.close()


@pytest.fixture(autouse=True)
def _no_probe_source_left():
    """The probe plan's and dense rows' id sources are kept per process (a worker's layers share them):
    none between tests."""
    yield
    from services.generator.plugin.scheduled_decode import ScheduledDecode

    ScheduledDecode.probe_row_ids = None
    ScheduledDecode.dense_row_ids = None
