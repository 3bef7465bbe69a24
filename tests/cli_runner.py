"""Running the `sparrow` command as a user would, from the repository root.

`sparrow(...)` runs it in this process (the unit tests' way: no interpreter start-up and no torch import
paid per call); `sparrow_process(...)` in a child process (the integration tests, and one smoke test per
command in tests/unit/cli/test_commands_as_processes.py). Both answer a `subprocess.CompletedProcess`
with the exit status and stdout and stderr as text.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The signals a command may take over (sparrow up and the services install handlers for these).
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def sparrow_process(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """`sparrow ARGS...` through `python -m sparrow_cli.main` in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "sparrow_cli.main", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def sparrow(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """`sparrow ARGS...` through `sparrow_cli.main.main` in this process.

    What a command may change for its process is put back afterwards: the working directory, the
    environment, signal handlers, the root logger's handlers and level, torch's thread count. An
    exception the command lets out is what the interpreter would make of it: its traceback on stderr
    and status 1. `timeout` is the child's limit in `sparrow_process`; here pytest-timeout bounds a test.
    """
    from sparrow_cli.main import main

    argv = [str(a) for a in args]
    out, err = _text_stream(), _text_stream()
    with _kept_process_state(), contextlib.chdir(REPO):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's --help and usage errors, or a command's own exit
                if isinstance(exc.code, int) or exc.code is None:
                    code = exc.code or 0
                else:
                    print(exc.code, file=sys.stderr)
                    code = 1
            except Exception:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
    return subprocess.CompletedProcess(["sparrow", *argv], code, _text(out), _text(err))


def _text_stream() -> io.TextIOWrapper:
    """A text stream with a binary buffer beneath (a command may write bytes to `sys.stdout.buffer`)."""
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="replace", write_through=True)


def _text(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode("utf-8", errors="replace")


@contextlib.contextmanager
def _kept_process_state():
    environ = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    root = logging.getLogger()
    root_handlers, root_level = list(root.handlers), root.level
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for s, h in handlers.items():
            signal.signal(s, h)
        for h in root.handlers[:]:
            if h not in root_handlers:
                root.removeHandler(h)
        root.setLevel(root_level)
        if threads is not None:
            torch.set_num_threads(threads)
