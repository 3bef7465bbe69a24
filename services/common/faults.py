"""Fault points the tests arm, so that a kill lands at a chosen moment of a run rather than after a sleep.

    SPARROW_FAULT=<point>[#N]    the process that reaches <point> (the Nth time; default the first) kills
                                 the run's launcher (`sparrow up`, whose pid its children find in
                                 SPARROW_UP_PID) and itself with SIGKILL

Points: `up:started` (the launcher, every service healthy, no step yet), `up:step` (the launcher, just
after it wrote a step's row), `trainer:checkpoint` (the trainer, a checkpoint's shards written and its
meta not yet, so that checkpoint is never completed), `trainer:publish` (the trainer, a policy
version's weights written and not yet published; the first is the version it starts from),
`trainer:setup-error` (a rank our trainer launcher started, its setup error noted for the launcher,
not yet exited 2: as a rank that a collective takes down on its way out). With
nothing armed a point costs one dictionary lookup. SIGKILL on both, as an OOM kill or a power cut
would: nothing gets to clean up; the services the launcher started get SIGTERM from the kernel
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "SPARROW_FAULT"
UP_PID_ENV = "SPARROW_UP_PID"


_reached: dict[str, int] = {}


def fault_point(point: str) -> None:
    """Kill the run's launcher and this process if `point` is the armed one, reached its Nth time."""
    armed = os.environ.get(FAULT_ENV)
    if not armed or armed.partition("#")[0] != point:
        return
    _reached[point] = _reached.get(point, 0) + 1
    times = armed.partition("#")[2]
    if _reached[point] != (int(times) if times.isdigit() else 1):
        return
    launcher = os.environ.get(UP_PID_ENV, "")
    if launcher.isdigit() and int(launcher) != os.getpid():
        try:
            os.kill(int(launcher), signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)
