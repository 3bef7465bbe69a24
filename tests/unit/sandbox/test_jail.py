"""The jail itself, run for real with bubblewrap: what a program can see and how each run ends."""

from __future__ import annotations

import pytest

from services.sandbox.jail import Jail, JailError, Limits
from services.sandbox.runtimes import PYTHON3, get_runtime
from tests.servers import require_binary

LIMITS = Limits(timeout_s=3, memory_mb=512)


@pytest.fixture(scope="module")
def jail() -> Jail:
    require_binary("bwrap")
    j = Jail()
    j.check(PYTHON3)
    return j


def run(jail: Jail, source: str, stdin: bytes = b"", limits: Limits = LIMITS):
    return jail.run(PYTHON3, source.encode(), stdin, limits)


def test_a_program_reads_stdin_and_writes_stdout(jail):
    out = run(jail, "print(input()[::-1])", b"abc\n")
    assert (out.status, out.exit_code, out.stdout) == ("ok", 0, b"cba\n")
    assert out.peak_memory_bytes > 1 << 20 and 0 < out.elapsed_s < 3


@pytest.mark.parametrize(
    ("source", "status"),
    [
        ("def f(:\n  pass\n", "compile_error"),
        ("raise ValueError('no')", "runtime_error"),
        ("import sys; sys.exit(3)", "runtime_error"),
        ("import ctypes; ctypes.string_at(0)", "runtime_error"),
        ("x = bytearray(16 << 30)", "memory"),
        ("while True: pass", "timeout"),
        ("import sys\nb = b'x' * (1 << 20)\nwhile True: sys.stdout.buffer.write(b)", "output_limit"),
    ],
)
def test_each_way_a_run_ends_has_its_status(jail, source, status):
    out = run(jail, source)
    assert out.status == status, out
    assert out.elapsed_s < LIMITS.timeout_s + 1


def test_the_program_sees_an_empty_environment_and_a_read_only_root(jail, monkeypatch):
    monkeypatch.setenv("SPARROW_SECURITY__TOKEN", "s3cret-token")
    out = run(jail, "import os; print(sorted(os.environ)); open('/x', 'w')")
    assert b"SPARROW" not in out.stdout and b"s3cret" not in out.stdout
    assert b"Read-only file system" in out.stderr
    out = run(jail, "import os; print(os.getpid(), os.listdir('/'), os.listdir('/proc')[:50])")
    pid, listing = out.stdout.split(b" ", 1)
    assert int(pid) < 10  # its own PID namespace
    assert b"'etc'" not in listing and b"'work'" not in listing and b"'root'" not in listing


def test_the_stderr_and_stdout_caps_are_separate_and_exact(jail):
    limits = Limits(timeout_s=3, max_output_bytes=1000)
    out = run(jail, "import sys; sys.stderr.write('e' * 999); print('o' * 10)", limits=limits)
    assert out.status == "ok" and len(out.stderr) == 999
    out = run(jail, "print('o' * 5000)", limits=limits)
    assert out.status == "output_limit" and len(out.stdout) == 1000


def test_an_unknown_language_is_named():
    with pytest.raises(ValueError, match="unknown language 'cobol'"):
        get_runtime("cobol")


def test_no_bubblewrap_refuses_in_one_line():
    with pytest.raises(JailError, match="bubblewrap .* is not installed"):
        Jail(bwrap="no-such-bwrap-binary")


def test_without_proc_the_jail_has_no_proc_and_still_runs():
    require_binary("bwrap")
    out = Jail(proc=False).run(PYTHON3, b"import os; print(os.path.exists('/proc/self'), os.getpid())", b"", LIMITS)
    assert out.status == "ok" and out.stdout.split()[0] == b"False"


def test_an_error_of_ours_mid_run_kills_the_jail(jail, monkeypatch):
    import os
    import time

    import services.sandbox.jail as jail_module

    def broken_drain(*args):
        time.sleep(0.5)  # the program is running by now
        raise RuntimeError("bug in the reader")

    monkeypatch.setattr(jail_module, "_drain", broken_drain)
    with pytest.raises(RuntimeError, match="bug in the reader"):
        run(jail, "import time; time.sleep(1000)")

    def alive() -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if b"/sandbox/main.py" in open(f"/proc/{pid}/cmdline", "rb").read():
                    found.append(pid)
            except OSError:
                pass
        return found

    deadline = time.monotonic() + 1  # the kernel empties the PID namespace once its init is gone
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive() == []


def test_peak_memory_of_a_run_that_is_killed_is_measured(jail):
    out = run(jail, "import time\nx = bytearray(200 << 20)\ntime.sleep(100)\n", limits=Limits(timeout_s=1.5))
    assert out.status == "timeout" and out.peak_memory_bytes >= 200 << 20
    forks = (
        "import os, time\nx = bytearray(60 << 20)\nfor _ in range(3):\n"
        "    if os.fork() == 0:\n        x[:] = b'1' * len(x)\n        break\ntime.sleep(100)\n"
    )
    out = run(jail, forks, limits=Limits(timeout_s=2))
    assert out.status == "timeout" and out.peak_memory_bytes >= 4 * (60 << 20)


def test_jails_left_by_a_sandbox_that_died_are_killed_and_no_others(jail, monkeypatch):
    """A SIGKILLed service cannot kill its jails, and bwrap's --die-with-parent misses a bwrap killed while
    it sets up (its init lives on, orphaned, as long as the program runs). Orphans are made here by hand, as
    processes carrying a jail's owner token, because the race itself cannot be hit on demand."""
    import fcntl
    import os
    import subprocess
    import time

    import services.sandbox.jail as jail_module

    def owned_by(owner: str) -> subprocess.Popen:
        return subprocess.Popen(["sleep", "1000"], env={"PATH": "/usr/bin:/bin", "JAIL_OWNER": owner})

    def lock_file(token: str) -> int:
        fd = os.open(os.path.join(jail_module._OWNERS_DIR, token), os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    os.makedirs(jail_module._OWNERS_DIR, exist_ok=True)
    os.close(lock_file("0ffdead0"))  # an owner that ended: its lock file is free
    held = lock_file("a11ve000")
    fcntl.flock(held, fcntl.LOCK_EX)  # an owner that lives (another open file: the lock conflicts)
    procs = {
        "orphan": owned_by("0ffdead0"),
        "orphan too": owned_by("0ffdead0"),
        "owner alive": owned_by("a11ve000"),
        "no lock file": owned_by("0000beef"),
        "ours": owned_by(jail.owner),
        "garbled": owned_by("../../etc"),
    }
    try:
        time.sleep(0.2)  # exec'd: their environ is readable
        killed = set(Jail().reap_orphans() + jail.reap_orphans())
        for p in procs.values():
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        alive = {name for name, p in procs.items() if p.poll() is None}
        assert alive == {"owner alive", "no lock file", "ours", "garbled"}, killed
        assert not os.path.exists(os.path.join(jail_module._OWNERS_DIR, "0ffdead0"))  # forgotten once free
        # Jail.run reaps too, at most every REAP_EVERY_S
        os.close(lock_file("0ffdead1"))
        later = procs["later"] = owned_by("0ffdead1")
        time.sleep(0.2)
        monkeypatch.setattr(jail, "_reaped_at", time.monotonic() - jail_module.REAP_EVERY_S)
        assert run(jail, "print(1)").status == "ok"
        assert later.wait(timeout=2) == -9
    finally:
        os.close(held)
        for p in procs.values():
            p.kill()
            p.wait()
