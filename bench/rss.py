"""A process's own peak resident memory, for the benches that measure it in child processes.

A child inherits its parent's high-water mark across fork and exec (getrusage's ru_maxrss is kept
across execve), so a child of a large parent (a test worker, a notebook, an engine) would report the
parent's peak. `reset_peak` starts the mark afresh (Linux: clear_refs 5); `peak_bytes` reads it back
(VmHWM), or ru_maxrss where the reset is not available.
"""

from __future__ import annotations

import resource

_reset = False


def reset_peak() -> bool:
    """Start this process's resident high-water mark afresh; whether it could."""
    global _reset
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _reset = True
    except OSError:
        pass
    return _reset


def peak_bytes() -> int:
    """This process's peak resident memory since `reset_peak` (since it started, where that was not possible)."""
    if _reset:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
