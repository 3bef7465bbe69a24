"""The same 3 training steps (fixed data, fp32) on 1 process and on 2 ranks (torchrun, FSDP2 over gloo, really
running): parameters equal within 1e-5 relative, the reported loss, alpha and p5 equal."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.servers import free_port

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("steps_worker.py")


def _run(out: Path, ranks: int, *extra: str) -> dict:
    env_cmd = [sys.executable, str(WORKER), str(out), *extra]
    if ranks > 1:
        env_cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(WORKER), str(out), *extra,
        ]  # fmt: skip
    r = subprocess.run(env_cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return {**json.loads(out.read_text()), "params": torch.load(str(out) + ".pt")}


def _close(a: dict, b: dict) -> None:
    for name, p in a.items():
        scale = p.abs().max().clamp(min=1e-12)
        assert float((p - b[name]).abs().max() / scale) <= 1e-5, name


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one") / "one.json", 1)


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_checkpoint_taken_under_one_world_size_resumes_under_another(tmp_path, one_rank, before, after):
    """Steps 1-2 on `before` ranks, a DCP checkpoint, step 3 on `after` ranks: the 1-process run's result."""
    ckpt = tmp_path / "checkpoints"
    _run(tmp_path / "first.json", before, "0", "2", str(ckpt))
    rest = _run(tmp_path / "rest.json", after, "2", "3", "", str(ckpt))
    assert rest["world_size"] == after and [s["step"] for s in rest["steps"]] == [2]
    last = one_rank["steps"][2]
    assert rest["steps"][0]["loss"] == pytest.approx(last["loss"], rel=1e-5, abs=1e-7)
    assert rest["steps"][0]["alpha_mean"] == pytest.approx(last["alpha_mean"], abs=1e-6)
    _close(one_rank["params"], rest["params"])


@pytest.mark.slow
def test_one_and_two_ranks_train_alike(tmp_path, one_rank):
    one = one_rank
    two = _run(tmp_path / "two.json", 2)
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["alpha_mean"] == pytest.approx(a["alpha_mean"], abs=1e-6)
        assert a["p5"].keys() == b["p5"].keys() and a["p5"]
        assert all(b["p5"][k] == pytest.approx(a["p5"][k], abs=1e-5) for k in a["p5"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)  # summed over ranks, not averaged
    assert one["params"].keys() == two["params"].keys()
    from trainer.model_io import load_model

    start = load_model(REPO / "models" / "tiny").state_dict()
    _close(one["params"], two["params"])
    assert any(not torch.equal(p, start[n]) for n, p in one["params"].items())  # the steps trained
