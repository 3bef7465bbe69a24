"""How a process ended and why, in one line: the words every supervisor of ours logs."""

from __future__ import annotations

import signal


def describe_exit(code: int) -> str:
    """'exit 1' or 'signal SIGKILL' for a child's return code (negative: the signal that ended it)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
