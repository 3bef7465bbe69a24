"""`sparrow bench sandbox`: programs per second through the jail at 1, 2 and 4 workers, and the jail's overhead.

Two programs: a trivial one (start-up dominates) and one that burns 0.5 s of CPU (the work dominates).
Workers are threads calling the jail concurrently, as the service's pool does (no HTTP in the figure).
The overhead is the median wall time of the trivial program jailed minus the same program run
unjailed with the same rlimits and empty environment (`insecure_local`).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from services.sandbox.jail import Jail, Limits
from services.sandbox.runtimes import PYTHON3

PROGRAMS = {
    "trivial": "print(sum(range(100)))\n",
    "cpu_0.5s": "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\nprint('done')\n",
}
LIMITS = Limits(timeout_s=30, memory_mb=512)


def _throughput(jail: Jail, source: str, workers: int, programs: int) -> dict:
    def one(_: int) -> str:
        return jail.run(PYTHON3, source.encode(), b"", LIMITS).status

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        statuses = list(pool.map(one, range(programs)))
    wall = time.perf_counter() - start
    ok = statuses.count("ok")
    return {
        "workers": workers,
        "programs": programs,
        "ok": ok,
        "seconds": round(wall, 3),
        "programs_per_s": round(ok / wall, 2),
    }


def _median_wall(jail: Jail, source: str, repeats: int) -> float:
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        jail.run(PYTHON3, source.encode(), b"", LIMITS)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def bench_sandbox(workers: tuple[int, ...] = (1, 2, 4), trivial: int = 40, cpu: int = 8, repeats: int = 20) -> dict:
    """The figures, as one JSON-ready dict."""
    jail, unjailed = Jail(), Jail(insecure_local=True)
    jail.check(PYTHON3)
    out: dict = {"python": PYTHON3.interpreter(), "throughput": {}}
    for name, count in (("trivial", trivial), ("cpu_0.5s", cpu * max(workers))):
        rows = [_throughput(jail, PROGRAMS[name], w, count) for w in workers]
        base = rows[0]["programs_per_s"]
        for row in rows:
            row["speedup_vs_1"] = round(row["programs_per_s"] / base, 2) if base else None
        out["throughput"][name] = rows
    jailed_s = _median_wall(jail, PROGRAMS["trivial"], repeats)
    plain_s = _median_wall(unjailed, PROGRAMS["trivial"], repeats)
    out["startup"] = {
        "jailed_median_s": round(jailed_s, 4),
        "unjailed_median_s": round(plain_s, 4),
        "overhead_s": round(jailed_s - plain_s, 4),
        "ratio": round(jailed_s / plain_s, 2),
        "repeats": repeats,
    }
    return out
