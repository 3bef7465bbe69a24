"""A policy published from 2 FSDP2 ranks (torchrun, gloo, really running: each tensor gathered in turn, rank 0
writing) is the folder one process publishes from the same weights: the same digest, the same bytes."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparrow.weight_delta import folder_digest
from tests.integration.trainer_dist.publish_worker import moved
from tests.servers import free_port
from trainer.hf_checkpoint import INDEX_NAME

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "models" / "tiny"
WORKER = Path(__file__).with_name("publish_worker.py")


def _untied(folder: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(TINY)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_two_ranks_publish_the_folder_one_process_publishes(tmp_path):
    from services.trainer.weights import save_hf_policy

    # tied in bf16 over several files (the tied head is one DTensor of two names), untied in fp32 over several,
    # tied in fp32 as one file
    cases = [(TINY, "bfloat16", 20_000), (_untied(tmp_path / "untied"), "float32", 20_000), (TINY, "float32", 10**9)]
    args = [str(a) for case in cases for a in case]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(WORKER), str(tmp_path / "ranks"), *args,
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    for i, (model_dir, dtype, shard_bytes) in enumerate(cases):
        assert (tmp_path / "ranks" / f"{i}.done").read_text() == "2\n"  # written under a world of 2
        one = tmp_path / "one" / str(i)
        one.mkdir(parents=True)
        save_hf_policy(moved(str(model_dir)), one, model_dir, dtype, shard_bytes)
        two = tmp_path / "ranks" / str(i)
        assert folder_digest(two) == folder_digest(one)
        names = sorted(p.name for p in one.iterdir())
        assert sorted(p.name for p in two.iterdir()) == names and (INDEX_NAME in names) == (shard_bytes < 10**9)
        assert all((two / n).read_bytes() == (one / n).read_bytes() for n in names), i
