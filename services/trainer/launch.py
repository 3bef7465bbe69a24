"""`sparrow trainer` as one process, as a rank, or as the launcher of this node's ranks.

    WORLD_SIZE set                 a rank that torchrun (ours or a user's) started: serve (main.serve)
    procs_per_node * nodes == 1    the trainer alone, after the checks below: serve
    otherwise                      the launcher: checks, then torchrun's elastic agent runs the ranks

The launcher first checks, in this process, what would make every rank exit 2 (prechecks.py): a
world size the config refuses, a model folder that cannot be built, a checkpoint of another model.
Then it runs torchrun's elastic agent in-process on `python -m sparrow_cli.main <the same command
line>`. In-process rather than a torchrun child, because the agent's result names each failed
rank's exit code: a setup error (exit 2) is neither restarted nor hidden behind torchrun's exit 1;
and the ranks are this process's own children, so they end with it (PR_SET_PDEATHSIG, main.py) and
signals reach them without a second launcher in between. One node: a rendezvous on a free loopback
port, as torchrun --standalone. Several: a static rendezvous at master_addr:master_port, node_rank
given (Kubernetes' indexed pods).

Exit status: 0 when every rank finished (or stopped on a signal after its checkpoint), 2 when a rank
stopped with a setup error, 1 otherwise. After any other failure every rank of the node starts again,
`restarts` times, and resumes from the last checkpoint. SIGTERM or SIGINT goes on to the ranks as
SIGTERM (rank 0 checkpoints, then orders the others to stop); those still running after
`stop_grace_s` are killed. Signals are taken by a thread of their own (through the wakeup fd), not
by the main thread, which may be blocked for minutes in the rendezvous's C++ waits: a signal before
any rank started ends this process at once, with nothing to checkpoint (exit 0).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import uuid
from pathlib import Path

from services.common.exits import describe_exit, first_line
from services.common.faults import fault_point
from services.trainer.config import TrainerServiceConfig

log = logging.getLogger("sparrow.trainer.launch")

SETUP_ERROR = 2  # a rank's exit status for a setup error (sparrow_cli: one line, exit 2)
# Where a rank notes its setup error before it exits (set by the launcher for each start of the ranks). The
# exit status alone does not say it for sure: a rank that exits 2 can take the others down with it in a
# collective (SIGABRT) and the agent, stopping the rest on the first failure it sees, may record only theirs.
SETUP_ERRORS_ENV = "SPARROW_TRAINER_SETUP_ERRORS"


def start(config: TrainerServiceConfig, argv: list[str]) -> int:
    """Run the trainer as `config` asks (see the module's table); the exit status.

    `argv` is this command line after the program (`trainer --config ...`): what each rank runs.
    Raises main.SetupError (one line) for what the checks find.
    """
    from services.trainer.main import SetupError, serve
    from services.trainer.prechecks import PrecheckError, check_start

    if started_as_rank():
        try:
            serve(config)
        except SetupError as exc:
            note_setup_error(str(exc))
            fault_point("trainer:setup-error")  # tests: the rank dies after its note, not with exit 2
            raise
        return 0
    d = config.distributed
    try:
        check_start(config, d.world)
    except PrecheckError as exc:
        raise SetupError(str(exc)) from None
    if d.world == 1:
        serve(config)
        return 0
    return Launcher(config, argv).run()


def started_as_rank() -> bool:
    """Whether this process is one rank a launcher (ours or a user's torchrun) started, not the command itself."""
    return "WORLD_SIZE" in os.environ


def note_setup_error(message: str) -> None:
    """As a rank our launcher started: note this rank's setup error where the launcher looks after the start."""
    folder = os.environ.get(SETUP_ERRORS_ENV)
    if not folder:
        return  # one process, or a rank a user's torchrun started: the exit status is all there is
    try:
        (Path(folder) / f"rank-{os.environ.get('RANK', '0')}").write_text(message)
    except OSError:
        pass  # the exit status still says 2


def setup_errors(folder: Path) -> dict[int, str]:
    """{global rank: its setup error} of the ranks that noted one in `folder`."""
    out = {}
    for path in folder.glob("rank-*"):
        try:
            out[int(path.name.removeprefix("rank-"))] = path.read_text()
        except (OSError, ValueError):
            continue
    return out


class Launcher:
    """This node's ranks under torchrun's elastic agent, started again after a failure; `run` returns the status."""

    def __init__(self, config: TrainerServiceConfig, argv: list[str]) -> None:
        self.d = config.distributed
        self.argv = list(argv)
        self.stopping = threading.Event()
        self._agent = None  # the running attempt's agent; read by the signal handler (no lock: it runs in this thread)

    def run(self) -> int:
        """Start the ranks (and again after a failure) until they finish, fail for good, or a signal stops them."""
        d = self.d
        # As torchrun: one thread per rank unless told otherwise (the config's `threads` sets torch's own).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # The agent's own handlers would kill the ranks with the signal; this launcher passes it on instead.
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
        # The Python-level handlers do nothing: what they would do runs in the watcher thread, woken through the
        # wakeup fd by the C-level handler even while the main thread waits inside C++.
        previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
        woken, wake = socket.socketpair()
        wake.setblocking(False)
        previous_fd = signal.set_wakeup_fd(wake.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(woken,), name="launcher-signals", daemon=True).start()
        where = f"node {d.node_rank} of {d.nodes}, " if d.nodes > 1 else ""
        log.info("starting %d trainer process(es) (%s%d in all)", d.procs_per_node, where, d.world)
        try:
            return self._attempts()
        finally:
            signal.set_wakeup_fd(previous_fd)
            wake.setblocking(True)
            wake.send(b"\0")  # the watcher's end
            wake.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _attempts(self) -> int:
        d = self.d
        for attempt in range(d.restarts + 1):
            if self.stopping.is_set():
                return 0
            notes = Path(tempfile.mkdtemp(prefix="sparrow-setup-errors-"))
            os.environ[SETUP_ERRORS_ENV] = str(notes)  # the ranks are spawned with this environment
            try:
                failures = self._attempt()
                noted = setup_errors(notes)
            finally:
                shutil.rmtree(notes, ignore_errors=True)
            if not failures:
                log.info("every trainer process on this node finished")
                return 0
            described = ", ".join(
                f"rank {r}: {describe_exit(code) if code is not None else 'stopped'}"
                + (" after its setup error" if r in noted and code != SETUP_ERROR else "")
                for r, code in sorted((failures | {r: failures.get(r) for r in noted}).items())
            )
            if noted or SETUP_ERROR in failures.values():  # what a rank said, whatever the agent recorded
                log.error("trainer processes stopped with a setup error (%s); not started again", described)
                return SETUP_ERROR
            if self.stopping.is_set():
                log.error("trainer processes did not stop cleanly (%s)", described)
                return 1
            if attempt < d.restarts:
                log.warning(
                    "trainer processes failed (%s); starting them again (%d of %d), from the last checkpoint",
                    described, attempt + 1, d.restarts,
                )  # fmt: skip
                continue
            after = f" after {d.restarts} restart(s)" if d.restarts else ""
            log.error("trainer processes failed (%s)%s", described, after)
        return 1

    def _attempt(self) -> dict[int, int]:
        """One start of this node's ranks under a fresh agent; {global rank: exit status} of those that failed."""
        from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        d = self.d
        if d.master_addr:  # fixed: every node names node 0 (Kubernetes' indexed pods)
            backend, endpoint, run_id = "static", f"{d.master_addr}:{d.master_port}", "sparrow-trainer"
            extra, master = {"rank": d.node_rank}, (d.master_addr, d.master_port)
        else:  # one node: torchrun --standalone's rendezvous, on a port free now
            backend, endpoint, run_id = "c10d", "localhost:0", uuid.uuid4().hex
            extra, master = {}, (None, None)
        params = RendezvousParameters(
            backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=d.nodes, max_nodes=d.nodes,
            timeout=int(d.join_timeout_s), **extra,
        )  # fmt: skip
        spec = WorkerSpec(
            role="trainer",
            local_world_size=d.procs_per_node,
            entrypoint=sys.executable,
            args=("-m", "sparrow_cli.main", *self.argv),
            rdzv_handler=get_rendezvous_handler(params),
            max_restarts=0,  # restarts are this launcher's, which knows a setup error from a crash
            monitor_interval=0.5,
            master_addr=master[0],
            master_port=master[1],
        )
        agent = LocalElasticAgent(
            spec, logs_specs=DefaultLogsSpecs(), start_method="spawn", shutdown_timeout=max(1, round(d.stop_grace_s))
        )
        self._agent = agent
        try:
            result = agent.run()
        except Exception as exc:  # the rendezvous: node 0 unreachable, the others not there in join_timeout_s
            log.error("the trainer processes did not start: %s", first_line(exc))
            return {-1: 1}
        finally:
            self._agent = None
            spec.rdzv_handler.shutdown()
        if result.state == WorkerState.SUCCEEDED:
            return {}
        return {rank: failure.exitcode for rank, failure in result.failures.items()} or {-1: 1}

    def _watch(self, woken: socket.socket) -> None:
        with woken:
            while (data := woken.recv(1)) and data[0] != 0:
                self._on_signal(data[0])

    def _on_signal(self, signum: int) -> None:
        if signum not in (signal.SIGTERM, signal.SIGINT) or self.stopping.is_set():
            return  # a second Ctrl-C: the grace period runs already
        self.stopping.set()
        agent = self._agent
        pids = [w.id for w in agent.get_worker_group().workers if w.id is not None] if agent is not None else []
        name = signal.Signals(signum).name
        if not pids:
            # Waiting at the rendezvous (or between two starts): no rank holds anything to save.
            log.info("%s before the trainer processes started: stopping", name)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(0)
        log.info(
            "%s: passing it on to %d trainer process(es); they get %.0f s to checkpoint and stop",
            name, len(pids), self.d.stop_grace_s,
        )  # fmt: skip
        _signal_groups(pids, signal.SIGTERM)
        timer = threading.Timer(self.d.stop_grace_s, self._kill_late, args=(pids,))
        timer.daemon = True
        timer.start()

    def _kill_late(self, pids: list[int]) -> None:
        alive = [pid for pid in pids if _alive(pid)]
        if alive:
            log.warning(
                "%d trainer process(es) still running after %.0f s: killing them", len(alive), self.d.stop_grace_s
            )
            _signal_groups(alive, signal.SIGKILL)


def _ignore(_signum: int, _frame) -> None:
    pass


def _signal_groups(pids: list[int], sig: signal.Signals) -> None:
    # Each rank leads a session of its own (the agent starts it so): its group holds what it started too.
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
