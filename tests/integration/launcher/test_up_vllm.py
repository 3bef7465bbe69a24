"""`sparrow up --engine vllm`: the production engine (vLLM with the sparse attention plugin, on CPU here)
in a real generator process, for two steps of the tiny model."""

import pytest

from report.history import read_history
from tests.integration.launcher.helpers import UpProcess, alive, processes, tiny_config

pytestmark = pytest.mark.slow


def test_two_steps_with_the_vllm_engine(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path / "up.toml")  # its engine = "reference" is overridden by the flag
    up = UpProcess(
        "--config", str(config), "--engine", "vllm", "--model-size", "tiny", "--steps", "2", "--generators", "1",
        "--no-controller", "--run-dir", str(run_dir), "--json",
    )  # fmt: skip
    try:
        code = up.wait(600)
    finally:
        up.kill()
    assert code == 0, up.proc.stderr.read()[-3000:]
    summary = up.lines[-1]
    assert summary["type"] == "summary" and summary["outcome"] == "completed" and summary["steps_done"] == 2
    assert summary["run"]["engine"] == "vllm"
    assert 'kind = "vllm"' in (run_dir / "services" / "gen-0.toml").read_text()
    assert summary["generator_policy_versions"]["gen-0"] >= 2  # vLLM loaded a policy the trainer published
    assert summary["work"]["lost"] == [] and summary["work"]["groups_trained"] == 4
    rows = read_history(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["p5"] for r in rows) and any(r["rollout_tokens_per_s"] for r in rows)
    assert (run_dir / "report" / "report.md").is_file()
    assert not [c["name"] for c in processes(run_dir).values() if alive(c["pid"])]
