"""DistillSparse and exact alpha on real gloo FSDP2 ranks (torchrun), fp32, activation checkpointing on: the same
3 steps on 1 process and on 2 ranks give the same policy (1e-5 relative), the same adapter (within 1% of one AdamW
step at lr 1e-3: Adam divides each gradient by its own running size, so a gloo sum rounded in another order moves a
weight by about 1e-6 on some CPUs, where a rank that trained on its own gradient alone moves it by a good part of a
step), the same exact alpha per token (1e-5), loss, adapter loss and probe; no gradient of the frozen policy is
computed or reduced during the adapter's step; a 2-rank DCP checkpoint with the adapter resumes on 1."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.servers import free_port

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("distill_worker.py")

pytestmark = pytest.mark.slow

ADAPTER_ABS = 1e-5  # 1% of one AdamW step at the adapter's lr 1e-3 (see the module's docstring)


def _run(out: Path, ranks: int, *extra: str) -> dict:
    cmd = [sys.executable, str(WORKER), str(out), *extra]
    if ranks > 1:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(WORKER), str(out), *extra,
        ]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=_env())
    assert r.returncode == 0, r.stderr[-4000:]
    return {**json.loads(out.read_text()), **torch.load(str(out) + ".pt")}


def _env() -> dict:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _close(a: dict, b: dict, rel: float = 0.0, abs_: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name, p in a.items():
        diff = float((p - b[name]).abs().max())
        assert diff <= abs_ + rel * float(p.abs().max()), (name, diff)


def _same_step(a: dict, b: dict) -> None:
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    ea, eb = torch.tensor(a["exact"], dtype=torch.float64), torch.tensor(b["exact"], dtype=torch.float64)
    assert ea.shape == eb.shape and not bool(ea.isnan().any())
    torch.testing.assert_close(eb, ea, atol=1e-5, rtol=0)
    da, db = a["distill"], b["distill"]
    assert da["tokens"] == db["tokens"] > 0
    for key in ("loss", "ppo_loss", "kl", "grad_norm"):
        assert db[key] == pytest.approx(da[key], rel=1e-4, abs=1e-6), key
    assert ("probe" in da) == ("probe" in db)
    for ra, rb in zip(da.get("probe", []), db.get("probe", []), strict=True):
        assert ra["tokens"] == rb["tokens"]
        assert rb["p5_with"] == pytest.approx(ra["p5_with"], abs=1e-5)
        assert rb["p5_without"] == pytest.approx(ra["p5_without"], abs=1e-5)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one") / "one.json", 1)


def test_distill_and_exact_alpha_train_alike_on_one_and_two_ranks_and_never_touch_theta(tmp_path, one_rank):
    one, two = one_rank, _run(tmp_path / "two.json", 2)
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert [s["step"] for s in two["steps"]] == [0, 1, 2]
    for a, b in zip(one["steps"], two["steps"], strict=True):
        _same_step(a, b)
    for run in (one, two):
        for s in run["steps"]:
            # While the adapter trained: no base gradient anywhere, and the gathered weights (a layer's, the
            # head's) did not even require one; the dense forwards of the same step did.
            assert not s["base_grads"]
            assert s["adapter_forwards_frozen"] and all(s["adapter_forwards_frozen"])
            assert s["dense_forwards_trainable"] and all(s["dense_forwards_trainable"])
    assert "probe" in one["steps"][0]["distill"] and "probe" not in one["steps"][1]["distill"]
    _close(one["params"], two["params"], rel=1e-5)
    _close(one["adapter"], two["adapter"], abs_=ADAPTER_ABS)
    from trainer.model_io import load_model

    start = load_model(REPO / "models" / "tiny").state_dict()
    assert any(not torch.equal(p, start[n]) for n, p in one["params"].items())  # the policy trained
    assert all(float(p.abs().max()) > 0 for n, p in one["adapter"].items() if "lora_B" in n)  # so did the adapter


def test_a_two_rank_checkpoint_with_the_adapter_resumes_on_one_rank(tmp_path, one_rank):
    """Steps 1-2 on 2 ranks, a DCP checkpoint (policy, optimizers, adapter), step 3 on 1 process: the 1-process run's
    step 3 and result; the adapter version is rank 0's (the others' copy was stale)."""
    ckpt = tmp_path / "checkpoints"
    first = _run(tmp_path / "first.json", 2, "0", "2", str(ckpt))
    rest = _run(tmp_path / "rest.json", 1, "2", "3", "", str(ckpt))
    assert first["world_size"] == 2 and rest["world_size"] == 1 and [s["step"] for s in rest["steps"]] == [2]
    assert rest["adapter_version"] == 2
    _same_step(one_rank["steps"][2], rest["steps"][0])
    _close(one_rank["params"], rest["params"], rel=1e-5)
    _close(one_rank["adapter"], rest["adapter"], abs_=ADAPTER_ABS)
