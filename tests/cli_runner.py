"""Running the `sparrow` command in a child process, as a user would, from the repository root."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sparrow(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """`sparrow ARGS...` through `python -m sparrow_cli.main`; stdout and stderr captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "sparrow_cli.main", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
