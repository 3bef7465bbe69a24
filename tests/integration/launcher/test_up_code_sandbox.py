"""Code rewards in the user's job: a TACO-shaped code dataset in Parquet (stdin/stdout and call-based rows),
`sparrow up --model DIR --data code.parquet --reward code --steps 2` with the sandbox as a child, and the
sandbox killed with SIGKILL while the first step's rewards run: they wait and retry, the launcher starts it
again, the run completes with no reward scored 0 for the outage and no group lost.

The checkpoint's weights are random (tests/fixtures), so its responses are no programs anyone would write:
`bare_code` sends every response to the sandbox whole, where each is a real jailed run (most end as
compile errors). What is checked is that every reward went through the sandbox, not what it scored.
"""

import json
import os
import signal
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.fixtures.qwen3_checkpoint import build_qwen3_checkpoint
from tests.integration.launcher.helpers import UpProcess, processes, wait_for_processes
from tests.servers import require_binary

pytestmark = pytest.mark.slow

ADD = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
LONGEST = {"fn_name": "longest", "inputs": [[["a", "bbb"]], [["x"]]], "outputs": [["bbb"], ["x"]]}


def _code_rows(count):
    """TACO's shape: the tests as JSON text, in extra_info.input_output (stdin/stdout) or the ground truth."""
    rows = []
    for i in range(count):
        call_based = i % 2 == 1
        task = "Write longest(words)." if call_based else "Read two integers and print their sum."
        rows.append(
            {
                "data_source": "taco",
                "prompt": [{"role": "user", "content": f"{task} Answer in a ```python block. ({i})"}],
                "ability": "code",
                "reward_model": {"style": "rule", "ground_truth": json.dumps(LONGEST) if call_based else None},
                "extra_info": {"index": i, "input_output": None if call_based else json.dumps(ADD)},
            }
        )
    return rows


def _request_lines(log_text: str) -> list[str]:
    return [line for line in log_text.splitlines() if " run: " in line and " passed, " in line]


def test_code_reward_through_the_sandbox_child_which_is_killed_mid_step(tmp_path):
    require_binary("bwrap")
    model_dir = build_qwen3_checkpoint(tmp_path / "Qwen3-test")
    data = tmp_path / "code.parquet"
    pq.write_table(pa.Table.from_pylist(_code_rows(8)), data)
    config = tmp_path / "up.toml"
    config.write_text(
        'engine = "reference"\n'
        "[timeouts]\nstart_s = 400\nstep_s = 400\nstop_grace_s = 15\n"
        "[trainer]\ngroups_per_step = 2\n"
        "[trainer.data]\nchat_template_kwargs = { enable_thinking = false }\n"
        "[trainer.sampling]\nn = 4\nmax_new_tokens = 16\n"
        "[trainer.reward]\nworkers = 2\n"
        "[trainer.reward.options.code]\nbare_code = true\n"
        '[generator.engine]\ndevice = "cpu"\nkernel_backend = "torch"\n'
        "[sandbox.pool]\nworkers = 2\n"
    )
    run_dir = tmp_path / "run"
    up = UpProcess(
        "--config", str(config), "--model", str(model_dir), "--data", str(data), "--reward", "code",
        "--steps", "2", "--dense", "--run-dir", str(run_dir), "--json",
    )  # fmt: skip
    log = run_dir / "logs" / "sandbox.log"
    try:
        first = wait_for_processes(up, run_dir, {"sandbox", "trainer"}, 400)["sandbox"]
        # The first reward the sandbox answered: step 1's are running. Kill it as the OOM killer would.
        deadline = time.monotonic() + 300
        while not _request_lines(log.read_text()):
            assert time.monotonic() < deadline and up.proc.poll() is None, up.stderr_so_far()
            time.sleep(0.05)
        os.kill(first["pid"], signal.SIGKILL)
        code = up.wait(600)
    finally:
        up.kill()
    assert code == 0, up.proc.stderr.read()[-3000:]
    summary = up.lines[-1]
    assert summary["outcome"] == "completed" and summary["steps_done"] == 2
    assert summary["work"]["lost"] == [] and summary["work"]["trained_twice"] == []
    assert {"name": "sandbox", "exit": "signal SIGKILL"} in summary["exits"]
    launcher_log = (run_dir / "logs" / "up.log").read_text()
    assert "sandbox exited (signal SIGKILL); restarting it in 0 s (1 of 5)" in launcher_log, launcher_log[-3000:]
    restarted = processes(run_dir)["sandbox"]
    assert restarted["restarts"] == 1 and restarted["pid"] != first["pid"]

    # Every reward went through the sandbox, before the kill and after the restart, and none scored 0 as
    # an error: those caught by the outage waited for the restarted sandbox.
    steps = [json.loads(line) for line in (run_dir / "trainer" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["reward_errors"] == 0 and set(s["reward_by_source"]) == {"taco"} for s in steps), steps
    text = log.read_text()
    starts = [i for i, line in enumerate(text.splitlines()) if "sandbox on http://127.0.0.1:" in line]
    assert len(starts) == 2, text[-3000:]
    after = _request_lines("\n".join(text.splitlines()[starts[1] :]))
    assert after, "the restarted sandbox answered no reward"
    # One request per trained sample, but a sample that stopped at once (eos first) may have no text to run.
    assert len(_request_lines(text)) >= sum(s["samples"] - s["finished_stop"] for s in steps) > 0
    groups = [json.loads(line) for line in (run_dir / "trainer" / "groups.log").read_text().splitlines()]
    assert {g["group"]["reward"] for g in groups if g.get("kind") == "enqueued"} == {"code"}
