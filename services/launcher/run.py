"""One `sparrow up` run, start to end: plan, start, supervise, stop, account, report.

Bad input is found by `make_plan` before anything starts. Then Redis, Prometheus and the code
sandbox start, then the generators, the controller and the trainer together, each phase healthy
before the next (see `UpRun.start`). The run ends when the trainer exits after its last step; a Ctrl-C (or
SIGTERM), a service that fails, or a run with no step for `timeouts.step_s` ends it early. A
generator that exits is reported and the run goes on with the others (its claimed groups are
reclaimed); only when none is left does the run fail. A sandbox that exits is started again (up to
`sandbox_restarts` times, after 0, 1, 2, 4, 8 s): the rewards that need it wait and retry meanwhile.
A trainer that crashes is started again too (`trainer_restarts` times): with one process by this
run, with several by `sparrow trainer`'s own launcher, which starts all its ranks again; it resumes
from its last checkpoint, and the groups it had trained after that are trained again, never twice
(its checkpoint names them). Neither restarts a trainer that exited 2 (a setup error).
Whatever the end, every child is stopped, the work ledger is read from Redis before Redis stops, and
the report is written from the history.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from report.evals import EVALS_FILE, read_evals
from report.run_report import SUMMARY_FILE, ReportError, build_report, headline
from services.common.exits import describe_exit
from services.common.faults import fault_point
from services.launcher.accounting import WORK_FILE, account
from services.launcher.cluster import Cluster, StartError
from services.launcher.config import UpConfig
from services.launcher.history import STEPS_FILE, History, HistorySources
from services.launcher.plan import RunPlan, make_plan, write_run_files
from services.launcher.resume import hold_run_folder, wait_for_earlier_services
from services.launcher.scrape import controller_speedup
from services.launcher.services import prompt_tokens
from services.launcher.tracking.base import Trackers
from services.launcher.tracking.factory import open_trackers

log = logging.getLogger("sparrow.up")

COMPLETED, INTERRUPTED, FAILED = "completed", "interrupted", "failed"


class RunError(RuntimeError):
    """The run cannot go on (a service failed, no step for too long)."""


def speedup_function(plan: RunPlan):
    """The cost model's predicted rollout speedup for a schedule (JSON dict; None: dense, 1.0).

    Speculative rollouts are priced by the acceptance the generators measure, which only the lossless
    controller follows: their prediction is the controller's own (its gauge, through Prometheus), and none
    without a controller. The lossy prediction of the same budgets would claim a speedup they do not give."""
    from sparrow.cost import predict
    from sparrow.hardware import get_hardware
    from sparrow.models import resolve_model
    from sparrow.schedule import Schedule

    if plan.up.decode == "speculative":
        url = plan.prometheus_url if plan.children.controller is not None else ""
        return lambda schedule: controller_speedup(url) if url else None
    t = plan.children.trainer
    c = plan.children.controller
    overhead = c.cost.step_overhead if c is not None else 0.0  # the controller's pricing, as it reports it
    cache: dict = {}

    def speedup_of(schedule: dict | None) -> float | None:
        if schedule is None:
            return 1.0
        try:
            if "spec" not in cache:
                cache["spec"] = (resolve_model(str(plan.model_dir)), get_hardware(plan.up.cost_hardware))
            model, hardware = cache["spec"]
            s = Schedule.from_dict(schedule)
            return predict(model, s, hardware, prompt_tokens(t), t.sampling.max_new_tokens, t.sampling.n,
                           step_overhead=overhead).speedup  # fmt: skip
        except (ValueError, OSError) as exc:  # an unknown model shape or hardware: the view shows "-"
            log.warning("no predicted speedup: %s", exc)
            return None

    return speedup_of


def _log_to(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "logs" / "up.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("sparrow.up")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler


def build_model(plan: RunPlan, progress) -> None:
    """`sparrow model build` for the missing own model (a child with its own log)."""
    out, size = plan.model_dir, plan.up.model_size
    progress.event(f"building the {size} model into {out} (first run only; see logs/model-build.log)")
    logfile = plan.run_dir / "logs" / "model-build.log"
    with logfile.open("ab") as f:
        argv = [sys.executable, "-m", "sparrow_cli.main", "model", "build", "--size", size, "--out", str(out)]
        code = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if code != 0:
        raise RunError(f"building the {size} model failed ({describe_exit(code)}); see {logfile}")


class Interrupts:
    """SIGINT and SIGTERM raise KeyboardInterrupt, and are remembered so that none is lost.

    Both are installed explicitly: a process started in the background of a non-interactive shell inherits
    SIGINT ignored, and Python then never raises KeyboardInterrupt, so Ctrl-C (or `kill -INT`) would do
    nothing. The handler raises wherever the main thread is, which may be code that swallows the exception
    (a finalizer run by the garbage collector: Python prints "Exception ignored" and goes on); `check`, called
    at every poll of the run, raises it again. Inside `deferred()` a signal is only remembered.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received = threading.Event()
        self._previous: dict = {}
        self._deferring = False

    def _handle(self, signum, frame) -> None:
        self.received.set()
        if not self._deferring:
            raise KeyboardInterrupt

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def ignore(self) -> None:
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        for sig, before in self._previous.items():
            signal.signal(sig, before)
        self._previous = {}

    def check(self) -> None:
        """KeyboardInterrupt when a signal came (whether or not its first raise got through)."""
        if self.received.is_set():
            raise KeyboardInterrupt

    @contextmanager
    def deferred(self):
        """A signal inside the block raises only when it ends (the handler always runs in the main thread)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        self.check()


class UpRun:
    """A run being carried out."""

    def __init__(self, plan: RunPlan, progress, interrupts: Interrupts) -> None:
        self.plan = plan
        self.progress = progress
        self.interrupts = interrupts
        self.cluster = Cluster(plan.run_dir, plan.up.timeouts.stop_grace_s)
        self.history: History | None = None
        self.exits: list[dict] = []
        self.started = time.monotonic()
        self._redis = None
        self.trackers = Trackers([])
        self._evals_tracked = 0  # the history's evaluation rows handed to the trackers
        self._restart_due: dict[str, float] = {}  # exited children to start again, and when

    def redis(self):
        if self._redis is None:
            import redis

            self._redis = redis.Redis.from_url(self.plan.redis_url, socket_timeout=5, socket_connect_timeout=5)
        return self._redis

    def start(self) -> None:
        """Stores, Prometheus and the sandbox first; then generators, controller and trainer together (each
        phase healthy before the next).

        The trainer and the generators load their models at the same time; the trainer holds its first
        prompts until every generator has connected (`wait_for_generators`), so none gets a head start and
        the throughput measured from the first step on is the cluster's.
        """
        timeout = self.plan.up.timeouts.start_s
        specs = self.plan.services()
        self.progress.event(f"starting {', '.join(s.name for s in specs)}; logs in {self.plan.run_dir / 'logs'}")
        for warning in self.plan.warnings:
            log.warning("%s", warning)
            self.progress.event(f"warning: {warning}")
        for phase in (("store", "monitor", "sandbox"), ("generator", "controller", "trainer")):
            for spec in specs:
                if spec.role in phase:
                    # Not inside the start: a child started but not yet recorded would be left running.
                    with self.interrupts.deferred():
                        self.cluster.start(spec)
            self.cluster.wait_ready(timeout, go_on=self.interrupts.check)
            fault_point("up:start")  # the first time: Redis and Prometheus up, the trainer not started
        self.progress.event("every service is healthy; training")

    def supervise(self, resume: bool = False) -> None:
        """Follow the steps until the trainer is done; RunError when the run cannot go on.

        `resume`: the history goes on from the run's rows so far (services/launcher/history.py).
        """
        p, up = self.plan, self.plan.up
        self.history = History(
            p.run_dir,
            HistorySources(
                steps_file=p.run_dir / "trainer" / STEPS_FILE,
                generator_metrics={
                    g.generator_id: f"http://127.0.0.1:{port}/metrics"
                    for g, port in zip(p.children.generators, p.ports.generator_metrics, strict=True)
                },
                redis_client=self.redis(),
                prometheus_url=p.prometheus_url,
                promql_window_s=up.promql_window_s,
                tau=up.tau,
                initial_schedule=None if up.dense else json.loads(p.schedule.to_json()),
                follow_redis=not up.dense,
                speedup_of=speedup_function(p),
                evals_file=p.run_dir / "trainer" / EVALS_FILE,
            ),
            resume=resume,
        )
        if resume:
            self.trackers.catch_up(self.history.rows)
        last_step = time.monotonic()
        while True:
            self.interrupts.check()
            if self._take_rows():
                last_step = time.monotonic()
            self._restart_due_children()
            for child in self.cluster.exited():
                code = child.returncode
                self.exits.append({"name": child.name, "exit": describe_exit(code)})
                if child.spec.role == "trainer":
                    self._take_rows()
                    if code == 0 and len(self.history.rows) >= up.steps:
                        return
                    if self._trainer_restarts(code) and child.restarts < up.trainer_restarts:
                        self._schedule_restart(child, code, up.trainer_restarts, "it resumes from its checkpoint")
                        continue
                    after = f" after {child.restarts} restart(s)" if child.restarts else ""
                    raise RunError(f"the trainer exited ({describe_exit(code)}){after}:\n{child.log_tail()}")
                if child.spec.role == "generator":
                    left = len(self.cluster.alive("generator"))
                    message = f"{child.name} exited ({describe_exit(code)}); {left} generator(s) go on"
                    log.warning(message)
                    self.progress.event(message)
                    if left == 0:
                        raise RunError(f"every generator has exited; the last:\n{child.log_tail()}")
                    continue
                if child.spec.role == "sandbox":
                    self._schedule_restart(child, code, up.sandbox_restarts, "its rewards wait")
                    continue
                raise RunError(f"{child.name} exited ({describe_exit(code)}):\n{child.log_tail()}")
            if time.monotonic() - last_step > up.timeouts.step_s:
                raise RunError(f"no training step finished in {up.timeouts.step_s:.0f} s; see the logs")
            time.sleep(up.timeouts.poll_s)

    def _trainer_restarts(self, code: int) -> bool:
        """Whether this run starts an exited trainer again (several processes: the trainer's launcher does).

        Not a clean exit before the last step (a bug a restart would meet again), not a setup error
        (exit 2: one line about the config or the run dir, the same on every start).
        """
        return self.plan.up.trainer_procs == 1 and code not in (0, 2)

    def _schedule_restart(self, child, code: int, limit: int, meanwhile: str) -> None:
        if child.restarts >= limit:
            raise RunError(
                f"{child.name} exited ({describe_exit(code)}) after {child.restarts} restart(s):\n{child.log_tail()}"
            )
        delay = 0.0 if child.restarts == 0 else float(min(2 ** (child.restarts - 1), 8))
        message = f"{child.name} exited ({describe_exit(code)}); restarting it in {delay:.0f} s"
        message += f" ({child.restarts + 1} of {limit}); {meanwhile}"
        log.warning(message)
        self.progress.event(message)
        self._restart_due[child.name] = time.monotonic() + delay

    def _restart_due_children(self) -> None:
        for name, due in list(self._restart_due.items()):
            if time.monotonic() >= due:
                del self._restart_due[name]
                with self.interrupts.deferred():
                    self.cluster.restart(name)
        for child in self.cluster.poll_ready():
            self.progress.event(f"{child.name} is up again (restart {child.restarts})")

    def _take_rows(self) -> bool:
        rows = self.history.poll() if self.history is not None else []
        # Evaluation rows first: in the history file they come before the step rows of the same poll.
        evals = self.history.eval_rows[self._evals_tracked :] if self.history is not None else []
        self._evals_tracked += len(evals)
        for row in evals:
            self.trackers.log_eval(row)
        for row in rows:
            log.info("step %d: reward %s p5 %s", row["step"], row["reward"], row["p5"])
            self.progress.step(row)
            self.trackers.log_row(row)
            fault_point("up:step")
        return bool(rows)

    def finish(self, outcome: str, error: str | None) -> dict:
        """Stop everything (work ledger read before Redis stops), write the summary and the report."""
        p = self.plan
        versions = self.history.sample_generators() if self.history is not None else {}
        self.cluster.stop(("generator", "controller", "trainer"))
        self._take_rows()
        work, final_schedule = {}, None
        try:
            if not p.up.dense:
                final_schedule = self.history.sources.initial_schedule if self.history else None
                raw = self.redis().get("sparrow:schedule:current")
                if raw:
                    final_schedule = json.loads(raw)
            work = account(self.redis(), p.run_dir / "trainer")
        except Exception as exc:  # Redis gone (it failed): the summary says so
            log.warning("cannot read the work ledger or the schedule from Redis: %s", exc)
        self.cluster.stop()
        if final_schedule is not None:
            (p.run_dir / "schedule.json").write_text(json.dumps(final_schedule, indent=1) + "\n")
        (p.run_dir / WORK_FILE).write_text(json.dumps(work, indent=1) + "\n")
        rows = self.history.rows if self.history is not None else []
        summary = {
            "outcome": outcome,
            "error": error,
            "run_dir": str(p.run_dir),
            "elapsed_s": round(time.monotonic() - self.started, 1),
            **headline(rows),
            "generator_policy_versions": versions,
            "final_schedule": final_schedule,
            "exits": self.exits,
            "work": work,
            "evals": read_evals(p.run_dir / "trainer"),
            "run": {
                "model": str(p.model_dir.name),
                "engine": p.up.engine,
                "generators": p.up.generators,
                "trainer_procs": p.up.trainer_procs,
                "mode": p.up.decode,
                "controller": p.children.controller is not None,
                "steps": p.up.steps,
            },
            "report": None,
        }
        (p.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        if rows:
            try:
                summary["report"] = str(build_report(p.run_dir))
            except (ReportError, OSError, ValueError) as exc:  # the run's data is kept; `sparrow report` can retry
                log.error("no report: %s", exc)
            (p.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        self.trackers.finish(Path(summary["report"]).parent if summary["report"] else None)
        if self.trackers.status:
            summary["tracking"] = self.trackers.status
            (p.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        return summary

    def open_tracking(self) -> None:
        """The trackers of `[tracking]`, given the resolved config of the run and of every service."""
        p = self.plan
        if not p.up.tracking.backends:
            return
        c = p.children
        config = {
            "up": p.up.dump_public(),
            "trainer": c.trainer.model_dump(mode="json"),
            "generator": c.generators[0].model_dump(mode="json"),
            "controller": c.controller.model_dump(mode="json") if c.controller is not None else None,
        }
        self.trackers = open_trackers(p.up.tracking, p.run_dir, config, self.progress.event)


def run_up(up: UpConfig, progress_factory, run_dir: Path | None = None, resume: bool = False) -> tuple[int, dict]:
    """Carry out one run; returns (exit status: 0 completed, 1 failed, 130 interrupted; the summary).

    `resume`: carry on the run of the folder `up.run_dir` (services/launcher/resume.py).
    SetupError and ConfigError (bad input) are raised before anything starts or is written.
    """
    plan = make_plan(up, run_dir, resume=resume)
    lock = hold_run_folder(plan.run_dir)
    try:
        if resume:
            wait_for_earlier_services(plan.run_dir, up.timeouts.stop_grace_s + 5)
        write_run_files(plan)
        return _run_planned(plan, progress_factory, resume)
    finally:
        lock.close()


def _run_planned(plan: RunPlan, progress_factory, resume: bool) -> tuple[int, dict]:
    up = plan.up
    handler = _log_to(plan.run_dir)
    progress = progress_factory(plan)
    interrupts = Interrupts()
    run = UpRun(plan, progress, interrupts)
    interrupts.install()
    outcome, error, summary = FAILED, None, None
    try:
        log.info(
            "%s run folder %s, config %s", "resuming" if resume else "run", plan.run_dir, json.dumps(up.dump_public())
        )
        if plan.build_model:
            build_model(plan, progress)
        run.start()
        # After the services are started: a tracker's thread importing its package while the launcher
        # forks a child could leave the child deadlocked before exec (subprocess's preexec_fn).
        run.open_tracking()
        fault_point("up:started")
        run.supervise(resume)
        outcome = COMPLETED
    except KeyboardInterrupt:
        outcome = INTERRUPTED
        progress.event("interrupted: stopping every service")
    except (StartError, RunError, OSError) as exc:
        error = str(exc)
        log.error("run failed: %s", exc)
        progress.event(f"failed: {error.splitlines()[0]}")
    finally:
        # Stopping must not be cut short by a second Ctrl-C: the children would be left running.
        interrupts.ignore()
        try:
            summary = run.finish(outcome, error)
        finally:
            interrupts.restore()
            if summary is None:
                progress.close()
            else:
                progress.finished(summary)
            logging.getLogger("sparrow.up").removeHandler(handler)
            handler.close()
    return {COMPLETED: 0, INTERRUPTED: 130, FAILED: 1}[outcome], summary
