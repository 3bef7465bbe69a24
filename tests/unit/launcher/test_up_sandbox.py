"""`sparrow up` and the code sandbox: started as a child when a reward of the run is `code` (or asked for),
a given sandbox_url used instead, the jail checked before anything starts, a sandbox that exits restarted.

The jail checks run the real bubblewrap; nothing else is started (the plan only), except in the restart
test, where the supervised children are small Python processes."""

import json
import sys

import pytest

from services.launcher.cluster import PROCESSES_FILE, Cluster, ServiceSpec
from services.launcher.config import UpConfig, service_schemas
from services.launcher.dry_run import DryRunError, dry_run, processes
from services.launcher.plan import SetupError, make_plan
from sparrow.config import ConfigError, load_config
from sparrow.config_set import parse_set_flags
from tests.cli_runner import sparrow
from tests.servers import require_binary, wait_until


def _up(*sets: str, **fields) -> UpConfig:
    base = {"model_size": "tiny", "engine": "reference", "with_controller": False, **fields}
    return load_config(UpConfig, None, base | parse_set_flags(UpConfig, list(sets), service_schemas()))


@pytest.fixture(autouse=True)
def _bwrap():
    require_binary("bwrap")


def test_a_code_reward_starts_the_sandbox_in_the_plan_with_its_port(tmp_path):
    ctx = dry_run(_up("trainer.reward.name=code"), tmp_path / "run")
    procs = {p["process"]: p for p in processes(ctx)}
    assert procs["sandbox"]["role"] == "sandbox" and procs["sandbox"]["ports"]["api"] > 0
    check = next(r for r in ctx.results if r["check"] == "sandbox")
    assert check["detail"].startswith(f"started by sparrow up at http://127.0.0.1:{ctx.ports.sandbox} (bubblewrap")
    assert ctx.children.sandbox.api.port == ctx.ports.sandbox and ctx.children.sandbox.api.host == "127.0.0.1"


def test_no_code_reward_no_sandbox_unless_asked_for(tmp_path):
    ctx = dry_run(_up(), tmp_path / "run")
    assert "sandbox" not in {p["process"] for p in processes(ctx)} and ctx.ports.sandbox == 0
    assert next(r for r in ctx.results if r["check"] == "sandbox")["detail"].startswith("none")
    ctx = dry_run(_up(with_sandbox="always"), tmp_path / "run")
    assert "sandbox" in {p["process"] for p in processes(ctx)}
    ctx = dry_run(_up("trainer.reward.name=code", with_sandbox="never"), tmp_path / "run")
    assert "sandbox" not in {p["process"] for p in processes(ctx)}


def test_the_plan_points_the_trainer_at_the_started_sandbox_with_its_own_token(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARROW_TOKEN", "the-cluster-token-never-for-the-sandbox")
    plan = make_plan(_up("trainer.reward.name=code", "sandbox.pool.workers=2"), tmp_path / "run")
    specs = {s.name: s for s in plan.services()}
    sandbox, trainer = specs["sandbox"], specs["trainer"]
    assert sandbox.argv[-3:] == ["sandbox", "--config", str(tmp_path / "run" / "services" / "sandbox.toml")]
    assert sandbox.log == tmp_path / "run" / "logs" / "sandbox.log"
    assert trainer.env["CODE_SANDBOX_URL"] == f"http://127.0.0.1:{plan.ports.sandbox}"
    assert trainer.env["CODE_SANDBOX_TOKEN"] == sandbox.env["SPARROW_SECURITY__TOKEN"] != plan.token
    assert not any(k.startswith("SPARROW_") for k in sandbox.env if k != "SPARROW_SECURITY__TOKEN")
    text = plan.config_files["sandbox.toml"]
    assert "workers = 2" in text and sandbox.env["SPARROW_SECURITY__TOKEN"] not in text
    assert "sandbox" in plan.ports.metrics_targets(False)


def test_a_given_sandbox_url_is_used_instead_of_starting_one(tmp_path, monkeypatch):
    monkeypatch.setenv("CODE_SANDBOX_TOKEN", "the-users-sandbox-token")
    plan = make_plan(_up("trainer.reward.name=code", sandbox_url="http://10.0.0.7:8490/"), tmp_path / "run")
    specs = {s.name: s for s in plan.services()}
    assert "sandbox" not in specs and plan.ports.sandbox == 0
    assert specs["trainer"].env["CODE_SANDBOX_URL"] == "http://10.0.0.7:8490"
    assert specs["trainer"].env["CODE_SANDBOX_TOKEN"] == "the-users-sandbox-token"


@pytest.mark.parametrize(
    "sets, fields, message",
    [
        (["trainer.reward.options.code.url=http://x:1"], {}, "trainer.reward.options.code.url is set by sparrow up"),
        (["sandbox.pool.workers=2"], {"with_sandbox": "never"}, "[sandbox] configures the started sandbox, but"),
        (["sandbox.api.port=9"], {}, "sandbox.api.port is set by sparrow up; use ports.sandbox instead"),
    ],
)
def test_sandbox_settings_that_cannot_apply_are_refused(tmp_path, sets, fields, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make_plan(_up("trainer.reward.name=code", *sets, **fields), tmp_path / "run")


def test_bubblewrap_missing_stops_the_launch_in_one_line_before_anything_starts(tmp_path):
    up = _up("trainer.reward.name=code", "sandbox.jail.bwrap=/no/such/bwrap")
    with pytest.raises(SetupError, match="bubblewrap .* is not installed.*insecure_local = true"):
        make_plan(up, tmp_path / "run")
    with pytest.raises(DryRunError, match="^sandbox: the sandbox will not run programs unjailed"):
        dry_run(up, tmp_path / "run")
    run_dir = tmp_path / "run"
    result = sparrow("up", "--model-size", "tiny", "--engine", "reference", "--reward", "code", "--run-dir", run_dir,
                     "--set", "sandbox.jail.bwrap=/no/such/bwrap", timeout=180)  # fmt: skip
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "bubblewrap (/no/such/bwrap) is not installed" in result.stderr
    assert not run_dir.exists()  # nothing written, nothing started


def test_insecure_local_set_explicitly_runs_with_the_warning(tmp_path):
    up = _up("trainer.reward.name=code", "sandbox.jail.bwrap=/no/such/bwrap", "sandbox.jail.insecure_local=true")
    plan = make_plan(up, tmp_path / "run")
    assert plan.children.sandbox.jail.insecure_local and any("UNJAILED" in w for w in plan.warnings)
    check = next(r for r in dry_run(up, tmp_path / "run").results if r["check"] == "sandbox")
    assert "UNJAILED" in check["detail"]


def test_an_exited_child_is_restarted_from_its_spec_and_counted(tmp_path):
    log = tmp_path / "logs" / "sandbox.log"
    code = "import sys, time; print('up', flush=True); time.sleep(1000)"
    spec = ServiceSpec("sandbox", "sandbox", [sys.executable, "-c", code], log, lambda: "up" in log.read_text())
    cluster = Cluster(tmp_path, stop_grace_s=5)
    first = cluster.start(spec)
    cluster.wait_ready(30)
    first.process.kill()
    wait_until(lambda: cluster.exited() != [], 30, "the exit seen")
    second = cluster.restart("sandbox")
    assert second.process.pid != first.process.pid and second.restarts == 1 and not second.ready
    wait_until(lambda: cluster.poll_ready() == [second], 30, "ready again")
    entry = json.loads((tmp_path / PROCESSES_FILE).read_text())[0]
    assert (entry["pid"], entry["restarts"], entry["ready"]) == (second.process.pid, 1, True)
    with pytest.raises(ValueError, match="still running"):
        cluster.restart("sandbox")
    cluster.stop()
