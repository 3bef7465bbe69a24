"""`sparrow up --dry-run`: every check a launch makes, and the plan, with nothing started or written.

The dry run is a list of named checks, run in order; each reads the config (and what the checks before
it found), returns one line saying what it found, and raises SetupError or ConfigError (one line) on the
first problem. A new kind of input gets one more `Check` in `CHECKS`, placed after what it depends on
(the "data" check reads the trainer's resolved config, so it comes after "services").
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.launcher.config import UpConfig
from services.launcher.plan import SetupError, default_run_dir, load_schedule, model_folder, require_fresh_run_dir
from services.launcher.ports import HOST, PortError, Ports, allocate
from services.launcher.sandbox import SandboxSetupError, configured_rewards, plan_sandbox
from services.launcher.services import ChildConfigs, resolve
from sparrow.schedule import Schedule


@dataclass
class DryRun:
    """What the checks found so far (each check fills in its part)."""

    up: UpConfig
    run_dir: Path
    model_dir: Path | None = None
    build_model: bool = False
    schedule: Schedule | None = None
    schedule_file: Path | None = None
    ports: Ports | None = None
    children: ChildConfigs | None = None
    rewards: set[str] = field(default_factory=set)  # reward names the trainer will use
    sandbox_url: str = ""
    results: list[dict] = field(default_factory=list)  # {"check", "ok", "detail"} in order


@dataclass(frozen=True)
class Check:
    """One named check: `run(ctx)` returns what it found (one line) or raises SetupError/ConfigError."""

    name: str
    run: Callable[[DryRun], str]


def _writable_folder(path: Path) -> str | None:
    """Why `path` cannot be made or written as a folder, or None."""
    existing = next((q for q in (path, *path.parents) if q.exists()), None)
    if existing is None:
        return None
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def check_tools(ctx: DryRun) -> str:
    found = []
    for binary, url in (("redis-server", ctx.up.redis_url), ("prometheus", ctx.up.prometheus_url)):
        if url:
            found.append(f"{binary.split('-')[0]} at {url}")
        elif shutil.which(binary) is None:
            raise SetupError(f"{binary} is not installed (scripts/setup.sh installs it), or give its URL in the config")
        else:
            found.append(f"{binary} on PATH")
    return ", ".join(found)


def check_run_folder(ctx: DryRun) -> str:
    require_fresh_run_dir(ctx.run_dir)
    problem = _writable_folder(ctx.run_dir)
    if problem:
        raise SetupError(f"run folder {ctx.run_dir}: {problem}")
    return f"{ctx.run_dir} ({'empty' if ctx.run_dir.exists() else 'new'})"


def check_model(ctx: DryRun) -> str:
    from trainer.model_io import ModelLoadError, check_model_folder

    ctx.model_dir, ctx.build_model = model_folder(ctx.up)
    if ctx.build_model:
        return f"{ctx.model_dir} is not built yet: `sparrow model build --size {ctx.up.model_size}` runs first"
    try:
        return f"{ctx.model_dir}: {check_model_folder(ctx.model_dir)}"
    except ModelLoadError as exc:
        raise SetupError(f"model folder {exc}") from None


def check_schedule(ctx: DryRun) -> str:
    ctx.schedule, ctx.schedule_file = load_schedule(ctx.up)
    s = ctx.schedule
    where = str(ctx.schedule_file) if ctx.schedule_file else s.name
    if ctx.up.dense:
        return f"dense rollouts; tail bins from {where} ({len(s.budgets)} bins of {s.bin_width} tokens)"
    return f"{where}: {len(s.budgets)} bins of {s.bin_width} tokens, budgets {list(s.budgets)}"


def check_cost_model(ctx: DryRun) -> str:
    from sparrow.hardware import MEASURED, HardwareError, get_hardware
    from sparrow.models import ModelSpecError, resolve_model

    if ctx.up.cost_hardware.lower() in MEASURED:
        return f"{ctx.up.cost_hardware.lower()} (this machine's, measured when first needed)"
    try:
        hardware = get_hardware(ctx.up.cost_hardware)
    except HardwareError as exc:
        raise SetupError(f"cost_hardware: {exc}") from None
    if ctx.build_model:
        return f"{hardware.name}"
    try:
        model = resolve_model(str(ctx.model_dir))
    except ModelSpecError as exc:  # the run goes on without a predicted speedup; said here
        return f"{hardware.name}; no predicted speedup for this model ({exc})"
    return f"{hardware.name}, model {model.name}"


def check_ports(ctx: DryRun) -> str:
    try:
        ctx.ports = allocate(ctx.up)
    except PortError as exc:
        raise SetupError(str(exc)) from None
    p = ctx.up.ports
    fixed = [f"{k} {v}" for k, v in p.model_dump().items() if v]
    if not fixed:
        return "every port is picked free at the start"
    return "fixed (free now): " + ", ".join(fixed) + "; the others are picked free at the start"


def check_services(ctx: DryRun) -> str:
    ctx.children = resolve(ctx.up, ctx.run_dir, ctx.model_dir, ctx.schedule, ctx.schedule_file, ctx.ports)
    names = ["trainer", *(g.generator_id for g in ctx.children.generators)]
    if ctx.children.controller is not None:
        names.append("controller")
    return "configs valid: " + ", ".join(names)


def check_data(ctx: DryRun) -> str:
    """The trainer's datasets and rewards, loaded, templated, filtered and imported as the trainer will."""
    from services.trainer.training_data import DataInputError, build_training_data, describe
    from trainer.model_io import ModelLoadError, load_tokenizer

    ctx.rewards = configured_rewards(ctx.children)
    if ctx.build_model:
        return "the chain task's rows, made with the model built at start"
    try:
        data = build_training_data(ctx.children.trainer, load_tokenizer(ctx.model_dir), ctx.model_dir)
    except (DataInputError, ModelLoadError) as exc:
        raise SetupError(str(exc)) from None
    ctx.rewards |= set(data.rewards.values())
    return "; ".join(describe(data))


def check_sandbox(ctx: DryRun) -> str:
    """Whether the run starts the code sandbox (its rewards say), its config, and that its jail runs here."""
    try:
        plan = plan_sandbox(ctx.up, ctx.children, ctx.ports, ctx.rewards)
    except SandboxSetupError as exc:
        raise SetupError(str(exc)) from None
    ctx.children, ctx.ports, ctx.sandbox_url = plan.children, plan.ports, plan.url
    return plan.describe() + "".join(f"; warning: {w}" for w in plan.warnings)


def check_devices(ctx: DryRun) -> str:
    import torch  # loaded already by the model check

    c = ctx.children
    cuda = torch.cuda.is_available()
    if c.trainer.device == "cuda" and not cuda:
        raise SetupError("trainer.device is cuda, but no CUDA device is visible here")
    for g in c.generators:
        if g.engine.kind == "reference" and g.engine.device == "cuda" and not cuda:
            raise SetupError(f"{g.generator_id}: generator.engine.device is cuda, but no CUDA device is visible here")
    found = f"{torch.cuda.device_count()} CUDA device(s)" if cuda else "no CUDA device (CPU)"
    return f"{found}; " + "; ".join(f"{name} on {where}" for name, where in _devices(ctx).items())


def check_tracking(ctx: DryRun) -> str:
    from services.launcher.tracking.factory import backend_dirs, missing_backends

    t = ctx.up.tracking
    if not t.backends:
        return "none"
    for missing in missing_backends(t):
        raise SetupError(missing)
    dirs = backend_dirs(t, ctx.run_dir)
    for backend, folder in dirs.items():
        problem = _writable_folder(folder)
        if problem:
            raise SetupError(f"tracking.{backend}: cannot write {folder}: {problem}")
    return ", ".join(f"{b} -> {dirs.get(b) or t.mlflow.tracking_uri}" for b in t.backends)


CHECKS: list[Check] = [
    Check("tools", check_tools),
    Check("run folder", check_run_folder),
    Check("model", check_model),
    Check("schedule", check_schedule),
    Check("cost model", check_cost_model),
    Check("ports", check_ports),
    Check("services", check_services),
    Check("data", check_data),
    Check("sandbox", check_sandbox),
    Check("devices", check_devices),
    Check("tracking", check_tracking),
]


class DryRunError(ValueError):
    """The first check that failed: '<check>: <what is wrong>' (one line)."""


def dry_run(up: UpConfig, run_dir: Path | None = None, checks: list[Check] | None = None) -> DryRun:
    """Run every check in order; DryRunError at the first failure. Nothing is started or written."""
    from sparrow.config import ConfigError

    ctx = DryRun(up, (run_dir or Path(up.run_dir or default_run_dir())).resolve())
    for check in CHECKS if checks is None else checks:
        try:
            detail = check.run(ctx)
        except (SetupError, ConfigError) as exc:
            raise DryRunError(f"{check.name}: {str(exc).splitlines()[0]}") from None
        ctx.results.append({"check": check.name, "ok": True, "detail": detail})
    return ctx


def _devices(ctx: DryRun) -> dict[str, str]:
    import torch

    c = ctx.children
    out = {"trainer": c.trainer.device}
    for g in c.generators:
        e = g.engine
        if e.kind == "reference":
            device = e.device if e.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            out[g.generator_id] = f"reference engine, {device}"
        else:
            out[g.generator_id] = f"vLLM, its platform's device ({e.gpu_memory_utilization:.0%} of its memory)"
    return out


def processes(ctx: DryRun) -> list[dict]:
    """The plan: every process the launch would start, its ports and its device."""
    up, p, c = ctx.up, ctx.ports, ctx.children
    rows = []
    if not up.redis_url:
        rows.append({"process": "redis", "role": "store", "ports": {"port": p.redis}, "device": "-"})
    if not up.prometheus_url:
        rows.append({"process": "prometheus", "role": "monitor", "ports": {"port": p.prometheus}, "device": "-"})
    devices = _devices(ctx)
    for i, g in enumerate(c.generators):
        ports = {"control": p.generator_control[i], "metrics": p.generator_metrics[i]}
        rows.append({"process": g.generator_id, "role": "generator", "ports": ports, "device": devices[g.generator_id]})
    if c.controller is not None:
        rows.append({"process": "controller", "role": "controller", "ports": {"api": p.controller}, "device": "-"})
    if c.sandbox is not None:
        rows.append({"process": "sandbox", "role": "sandbox", "ports": {"api": p.sandbox}, "device": "cpu"})
    ports = {"grpc": p.trainer_grpc, "metrics": p.trainer_metrics}
    rows.append({"process": "trainer", "role": "trainer", "ports": ports, "device": c.trainer.device})
    if ctx.build_model:
        rows.insert(0, {"process": "model build", "role": "setup", "ports": {}, "device": "cpu"})
    return rows


def summary(ctx: DryRun) -> dict:
    """The dry run as one JSON object (`--dry-run --json`)."""
    return {
        "type": "dry_run",
        "ok": True,
        "run_dir": str(ctx.run_dir),
        "model_dir": str(ctx.model_dir),
        "steps": ctx.up.steps,
        "checks": ctx.results,
        "processes": processes(ctx),
    }


def text(ctx: DryRun) -> list[str]:
    """The dry run for a terminal: the checks, then the processes with their ports and devices."""
    width = max(len(r["check"]) for r in ctx.results)
    lines = [f"  ok  {r['check']:<{width}}  {r['detail']}" for r in ctx.results]
    lines += ["", f"plan: {ctx.up.steps} steps in {ctx.run_dir} (ports on {HOST}; free ones picked again at the start)"]
    for row in processes(ctx):
        ports = ", ".join(f"{k} {v}" for k, v in row["ports"].items()) or "-"
        lines.append(f"  {row['process']:<12} {row['role']:<10} {ports:<28} {row['device']}")
    lines.append("dry run: every check passed; nothing was started")
    return lines
