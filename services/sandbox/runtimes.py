"""The table of runtimes a program may be written for: how it is run, what of the host it needs to see.

A runtime names an interpreter and the host paths the jail binds read-only for it. Everything else of
the host stays out of the jail. Python 3 is the only entry so far; an interpreted language is one more
entry. A compiled one also needs a compile step run once per program in the jail, with the binary kept
between its test cases (not built yet).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Runtime:
    """How one language is run inside the jail."""

    name: str
    source_name: str
    """file name the program is written to inside the jail (under /sandbox)"""
    run: tuple[str, ...]
    """command run for each test case; `{source}` is the program's path in the jail"""
    candidates: tuple[str, ...]
    """host paths of the interpreter, first existing wins (it must lie under one of `binds`)"""
    binds: tuple[str, ...] = ("/usr",)
    """host folders bound read-only (only those that exist); merged-/usr systems link /bin and /lib into it"""
    compile_error: re.Pattern[str] | None = None
    """a run whose stderr ends with this, and exit status 1, never started: `compile_error`"""
    memory_error: re.Pattern[str] = field(default=re.compile(r"MemoryError|Cannot allocate memory|bad_alloc"))
    """stderr that says the program ran out of its address-space limit"""

    def interpreter(self) -> str | None:
        """The first existing candidate path, or None where the runtime is not installed."""
        return next((p for p in self.candidates if os.access(p, os.X_OK)), None)


# `-I` isolated (no PYTHON* variables, no user site, no script folder on sys.path), `-B` writes no
# .pyc files (the jail's /sandbox is read-only anyway), `-u` unbuffered so output up to a crash is kept.
PYTHON3 = Runtime(
    name="python3",
    source_name="main.py",
    run=("{interpreter}", "-I", "-B", "-u", "{source}"),
    candidates=("/usr/bin/python3", "/usr/local/bin/python3"),
    # A SyntaxError in the main script is printed without a traceback header, before anything runs.
    compile_error=re.compile(r"\A(?!Traceback)[\s\S]*^(SyntaxError|IndentationError|TabError): .*\s*\Z", re.M),
)

RUNTIMES: dict[str, Runtime] = {r.name: r for r in (PYTHON3,)}


def get_runtime(name: str) -> Runtime:
    """The runtime called `name`; ValueError naming the known ones otherwise."""
    try:
        return RUNTIMES[name]
    except KeyError:
        raise ValueError(f"unknown language {name!r} (known: {', '.join(RUNTIMES)})") from None
