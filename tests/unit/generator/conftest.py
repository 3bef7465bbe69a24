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
