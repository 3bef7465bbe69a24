"""Activation checkpointing per decoder layer under FSDP2 (2 ranks, torchrun, gloo, really running): the gradients of
two training steps equal those without it in fp32, and each layer really ran again in the backward."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import free_port

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("checkpointing_worker.py")


@pytest.mark.slow
def test_checkpointed_layers_give_the_same_gradients_under_fsdp2(tmp_path):
    out = tmp_path / "out.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(WORKER), str(out),
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())
    assert r.returncode == 0, r.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    for step in result["steps"]:
        plain, wrapped = step["losses"]
        assert wrapped == pytest.approx(plain, rel=1e-6, abs=1e-9)
        assert step["grad_rel_diff"] <= 1e-6, step
        # Scoring (no grad) runs each MLP once per micro-batch in both; the update once more in the plain
        # model and twice more in the checkpointed one (its forward, then the recompute in the backward).
        scoring_and_update, with_recompute = step["mlp_calls"]
        assert scoring_and_update > 0 and scoring_and_update % (2 * result["layers"]) == 0
        assert with_recompute == scoring_and_update * 3 // 2


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
