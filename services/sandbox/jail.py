"""The jail: one program run in bubblewrap with nothing of the host but a read-only /usr.

Each run gets new user, PID, network, IPC, UTS, cgroup and mount namespaces; its root is a fresh tmpfs
made read-only after the runtime's folders are bound in read-only, with a small writable tmpfs at /tmp
(the work dir) and a fresh procfs of its own PID namespace. The environment is empty but for PATH, HOME
and LANG, so the service's own variables (its token among them) never reach the program. Inside, before
the program starts, `prlimit` sets the rlimits: CPU seconds, address space, processes, file size, no core
files. Outside, a wall-clock deadline kills the whole jail, and stdout and stderr are read as they come
and the jail killed once either passes its cap.

Killing works on the jail as a whole: bwrap runs in a session of its own (its process group is killed),
its init inside the PID namespace dies with it (--die-with-parent), and when that init dies the kernel
kills every process left in the namespace, forks that moved to other sessions included.

A service killed outright (SIGKILL, the OOM killer) cannot kill its jails, and --die-with-parent has a gap:
a bwrap killed while it sets up leaves its init behind, orphaned, for as long as the program runs (about
one kill in 40 in the first 30 ms here). Every jail carries its owner's token (random, so it tells a
program that reads /proc/1/environ nothing of the host) in bwrap's environment; the owner holds a lock
on a file of that name for its life. Each Jail kills the jails whose owner's lock is free: when it is
made (a restarted service cleans up after the one that died) and at most every `REAP_EVERY_S` after.

As root, the service drops to an unprivileged uid (`uid`, default nobody) before it starts bwrap: root's
own processes are exempt from the process limit, and a program that got out would be nobody.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

from services.sandbox.runtimes import Runtime

log = logging.getLogger("sparrow.sandbox")

STATUSES = ("ok", "timeout", "memory", "output_limit", "runtime_error", "compile_error", "sandbox_error")
"""What a run can end as; a test comparison turns `ok` into `passed` or `failed`."""
_READ_CHUNK = 1 << 16
REAP_EVERY_S = 5.0
_OWNER_VAR = "JAIL_OWNER"
_OWNERS_DIR = os.path.join(tempfile.gettempdir(), f"sparrow-jail-owners-{os.geteuid()}")
_SETUP_EXIT = 125
"""prlimit or the interpreter could not start (bwrap and prlimit both use small codes for their own errors)"""


class JailError(RuntimeError):
    """The jail cannot run on this machine (no bubblewrap, no user namespaces, no runtime); one line."""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 32
    max_file_mb: int = 16
    max_output_bytes: int = 1 << 20
    tmpfs_mb: int = 64


@dataclass
class Outcome:
    """How one run ended."""

    status: str
    exit_code: int | None
    signal: int | None
    elapsed_s: float
    cpu_s: float
    peak_memory_bytes: int
    stdout: bytes
    stderr: bytes
    detail: str = ""


class Jail:
    """Runs programs of a runtime in bubblewrap (or, with `insecure_local`, unjailed but limited)."""

    def __init__(self, bwrap: str = "bwrap", uid: int = 65534, insecure_local: bool = False, proc: bool = True) -> None:
        self.insecure_local, self.proc = insecure_local, proc
        self.bwrap = shutil.which(bwrap) if not insecure_local else None
        self.prlimit = shutil.which("prlimit", path="/usr/bin:/bin")
        self.uid = uid if os.geteuid() == 0 else None
        if not insecure_local and self.bwrap is None:
            raise JailError(f"bubblewrap ({bwrap}) is not installed: apt-get install bubblewrap (or insecure_local)")
        if self.prlimit is None:
            raise JailError("prlimit (util-linux) is not installed; the jail sets its rlimits with it")
        self._owner: tuple[int, str, int] | None = None  # (pid, token, fd of the held lock)
        self._reaped_at = -math.inf
        self._reap_lock = threading.Lock()
        self.reap_orphans()

    @property
    def owner(self) -> str:
        """The token this process's jails carry (a Jail used after a fork takes a token of the child's own)."""
        pid = os.getpid()
        if self._owner is None or self._owner[0] != pid:
            token = secrets.token_hex(8)
            os.makedirs(_OWNERS_DIR, mode=0o700, exist_ok=True)
            fd = os.open(os.path.join(_OWNERS_DIR, token), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # held until this process ends, however it ends
            self._owner = (pid, token, fd)
        return self._owner[1]

    def reap_orphans(self) -> list[int]:
        """Kill the jails whose owning process is gone; the pids killed."""
        with self._reap_lock:
            self._reaped_at = time.monotonic()
            killed, gone = [], {}
            for pid, owner in _jails():
                if owner == self.owner:
                    continue
                if owner not in gone:
                    gone[owner] = _owner_gone(owner)
                if not gone[owner]:
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)  # the namespace's init: the kernel kills the rest with it
                except (ProcessLookupError, PermissionError):
                    continue
                killed.append(pid)
            if killed:
                log.warning("killed %d jail process(es) left by a sandbox that is gone: %s", len(killed), killed)
            _forget_gone_owners()  # after the kills: a free lock's jails were all found above
            return killed

    def check(self, runtime: Runtime) -> None:
        """Run an empty program once; JailError with bubblewrap's own words when the jail cannot start."""
        if runtime.interpreter() is None:
            raise JailError(f"runtime {runtime.name}: none of {', '.join(runtime.candidates)} is installed")
        out = self.run(runtime, b"pass\n", b"", Limits(timeout_s=20))
        if out.status != "ok":
            why = (out.detail or out.stderr.decode("utf-8", "replace")).strip().splitlines()
            if self.insecure_local:
                raise JailError(f"runtime {runtime.name} cannot run a program: {why[-1] if why else out.status}")
            raise JailError(
                "bubblewrap cannot run a jail here "
                f"({why[-1] if why else out.status}); it needs user namespaces (kernel.unprivileged_userns_clone=1,"
                " user.max_user_namespaces > 0; in a container: see docs/sandbox.md)"
            )

    def run(self, runtime: Runtime, source: bytes, stdin: bytes, limits: Limits) -> Outcome:
        """Run `source` once with `stdin`; never raises on what the program does."""
        if time.monotonic() - self._reaped_at >= REAP_EVERY_S:
            self.reap_orphans()
        fd = os.memfd_create("program", os.MFD_CLOEXEC)
        status_r, status_w = os.pipe()
        workdir = tempfile.mkdtemp(prefix="sparrow-sandbox-") if self.insecure_local else None
        if workdir is not None and self.uid is not None:
            os.chown(workdir, self.uid, self.uid)
        try:
            os.write(fd, source)
            os.lseek(fd, 0, os.SEEK_SET)
            if workdir is not None:
                argv, cwd = self._local_argv(runtime, fd, workdir, limits), workdir
                pass_fds: tuple[int, ...] = (fd,)
            else:
                argv, cwd = self._bwrap_argv(runtime, fd, status_w, limits), "/"
                pass_fds = (fd, status_w)
            return self._execute(argv, cwd, pass_fds, stdin, limits, runtime, status_r)
        finally:
            # each closed exactly once: in a threaded service a second close could hit another run's new fd
            for f in (fd, status_r, status_w):
                os.close(f)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)

    def _limits_argv(self, limits: Limits) -> list[str]:
        cpu = max(1, math.ceil(limits.timeout_s))
        return [
            self.prlimit,
            f"--cpu={cpu}:{cpu + 1}",
            f"--as={limits.memory_mb << 20}",
            f"--nproc={limits.max_processes}",
            f"--fsize={limits.max_file_mb << 20}",
            "--core=0",
            "--",
        ]

    def _command(self, runtime: Runtime, source_path: str) -> list[str]:
        interpreter = runtime.interpreter()
        if interpreter is None:
            raise JailError(f"runtime {runtime.name}: none of {', '.join(runtime.candidates)} is installed")
        return [part.format(interpreter=interpreter, source=source_path) for part in runtime.run]

    def _bwrap_argv(self, runtime: Runtime, fd: int, status_fd: int, limits: Limits) -> list[str]:
        argv = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session"]
        argv += ["--cap-drop", "ALL", "--hostname", "sandbox"]
        for path in runtime.binds:
            if os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        # merged-/usr systems link these into /usr; elsewhere they are folders of their own to bind
        for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        # A fresh procfs of the jail's own PID namespace; container runtimes that mask parts of their /proc
        # (Docker's and Kubernetes' default) refuse this mount, and the jail then has no /proc at all.
        argv += ["--proc", "/proc"] if self.proc else []
        argv += ["--dev", "/dev"]
        argv += ["--size", str(limits.tmpfs_mb << 20), "--tmpfs", "/tmp"]
        argv += ["--perms", "0444", "--ro-bind-data", str(fd), f"/sandbox/{runtime.source_name}"]
        argv += ["--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
        argv += ["--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
        argv += ["--setenv", "LANG", "C.UTF-8", "--json-status-fd", str(status_fd), "--"]
        return argv + self._limits_argv(limits) + self._command(runtime, f"/sandbox/{runtime.source_name}")

    def _local_argv(self, runtime: Runtime, fd: int, workdir: str, limits: Limits) -> list[str]:
        # Development only: the same limits and an empty environment, but the host's file system and network.
        path = os.path.join(workdir, runtime.source_name)
        with open(path, "wb") as f:
            f.write(os.pread(fd, os.fstat(fd).st_size, 0))
        return ["env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", f"HOME={workdir}", "LANG=C.UTF-8"] + (
            self._limits_argv(limits) + self._command(runtime, path)
        )

    def _execute(self, argv, cwd, pass_fds, stdin, limits, runtime, status_r) -> Outcome:
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                start_new_session=True,
                user=self.uid,
                group=self.uid,
                extra_groups=[] if self.uid is not None else None,
                env={"PATH": "/usr/bin:/bin", _OWNER_VAR: self.owner},  # bwrap's own; --clearenv for the program
            )
        except OSError as exc:
            return Outcome("sandbox_error", None, None, 0.0, 0.0, 0, b"", b"", f"cannot start the jail: {exc}")
        try:
            writer = threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True)
            writer.start()
            deadline = start + limits.timeout_s
            memory = _PeakMemory(proc.pid)
            out, err, why = _drain(proc, deadline, limits.max_output_bytes, memory)
            if why:
                _kill(proc)
            wait_status, usage = _reap(proc, deadline)
            if wait_status is None:  # the pipes closed but the jail outlived the deadline (closed its own stdout)
                why = "timeout"
                _kill(proc)
                _, wait_status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(wait_status)  # Popen must not wait for it again
        finally:
            if proc.returncode is None:  # an error of ours mid-run: the jail must not outlive it
                _kill(proc)
                proc.wait()
        elapsed = time.monotonic() - start
        writer.join(timeout=1)
        cpu = usage.ru_utime + usage.ru_stime
        peak = max(usage.ru_maxrss * 1024, memory.peak)
        started, exit_code = _read_status(status_r) if self.bwrap and not self.insecure_local else (True, None)
        if exit_code is None and proc.returncode is not None and proc.returncode >= 0:
            exit_code = proc.returncode
        sig = -proc.returncode if proc.returncode < 0 else None
        if exit_code is not None and exit_code > 128 and sig is None:
            sig = exit_code - 128  # bwrap's init reports a program killed by signal N as 128 + N
        base = dict(elapsed_s=elapsed, cpu_s=cpu, peak_memory_bytes=peak, stdout=out, stderr=err)
        if why:
            return Outcome(why, exit_code, sig, detail=_WHY[why], **base)
        if not started:
            return Outcome("sandbox_error", exit_code, sig, detail=err.decode("utf-8", "replace").strip(), **base)
        return Outcome(_classify(runtime, exit_code, sig, cpu, limits, err), exit_code, sig, **base)


_WHY = {"timeout": "wall-clock timeout", "output_limit": "output over the cap"}


def _feed(pipe, data: bytes) -> None:
    try:
        if data:
            pipe.write(data)
    except (BrokenPipeError, OSError):
        pass  # the program stopped reading (exited or was killed): not an error of ours
    finally:
        try:
            pipe.close()
        except OSError:
            pass


class _PeakMemory:
    """The most memory the jail's processes held, sampled from /proc while it runs.

    A run that is killed is never waited for by its own parents, so its rusage says nothing of it; the
    samples (every 0.1 s and at the end of the output) see the processes' high-water marks and, for a
    program that forks, the sum of their resident sets.
    """

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0

    def sample(self) -> None:
        total, stack, seen = 0, [self.pid], 0
        while stack and seen < 4096:
            pid = stack.pop()
            seen += 1
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        stack += [int(c) for c in f.read().split()]
                if pid == self.pid:
                    continue  # bwrap's own monitor, outside the jail
                with open(f"/proc/{pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except (OSError, ValueError):
                continue  # gone meanwhile
            hwm = int(fields.get("VmHWM", "0 kB").split()[0]) * 1024
            total += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
            self.peak = max(self.peak, hwm)
        self.peak = max(self.peak, total)


def _drain(proc: subprocess.Popen, deadline: float, cap: int, memory: _PeakMemory) -> tuple[bytes, bytes, str | None]:
    """Read stdout and stderr until both close, the deadline passes or one goes over `cap`."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    why = None
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                why = "timeout"
                break
            events = sel.select(timeout=min(left, 0.1))
            memory.sample()
            for key, _ in events:
                try:
                    chunk = os.read(key.fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                buf += chunk
                if len(buf) > cap:
                    del buf[cap:]
                    why = "output_limit"
            if why:
                break
    finally:
        sel.close()
    proc.stdout.close()
    proc.stderr.close()
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), why


def _reap(proc: subprocess.Popen, deadline: float):
    """(wait status, rusage) of the jail once it ends before `deadline`, else (None, None)."""
    while True:
        pid, wait_status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return wait_status, usage
        if time.monotonic() >= deadline:
            return None, None
        time.sleep(0.002)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _owner_gone(token: str) -> bool:
    """True when the owner's lock file exists and nobody holds it (a token without a file is left alone)."""
    if not token.isalnum():
        return False
    path = os.path.join(_OWNERS_DIR, token)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: the owner lives
    finally:
        os.close(fd)
    return True


def _forget_gone_owners() -> None:
    """Remove the lock files nobody holds (owners that ended, cleanly or not)."""
    try:
        names = os.listdir(_OWNERS_DIR)
    except OSError:
        return
    for name in names:
        if _owner_gone(name):
            try:
                os.unlink(os.path.join(_OWNERS_DIR, name))
            except OSError:
                pass


def _jails() -> list[tuple[int, str]]:
    """(pid, owner) of every live process that bwrap started for a Jail, any service's."""
    found, prefix = [], f"{_OWNER_VAR}=".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue  # gone, or not ours to read
        for entry in environ.split(b"\0"):
            if entry.startswith(prefix):
                found.append((int(name), entry[len(prefix) :].decode("ascii", "replace")))
                break
    return found


def _read_status(fd: int) -> tuple[bool, int | None]:
    """(the program started, its exit code) from bubblewrap's --json-status-fd stream."""
    raw = b""
    os.set_blocking(fd, False)
    try:
        while chunk := os.read(fd, _READ_CHUNK):
            raw += chunk
    except BlockingIOError:
        pass
    started, code = False, None
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        started = started or "child-pid" in doc
        code = doc.get("exit-code", code)
    return started, code


def _classify(runtime: Runtime, exit_code: int | None, sig: int | None, cpu: float, limits: Limits, err: bytes) -> str:
    if exit_code == 0 and sig is None:
        return "ok"
    if sig in (signal.SIGXCPU, signal.SIGKILL) and cpu >= max(1, math.ceil(limits.timeout_s)) - 0.05:
        return "timeout"  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
    text = err[-4096:].decode("utf-8", "replace")
    if exit_code == 1 and runtime.compile_error is not None and runtime.compile_error.search(text):
        return "compile_error"
    if runtime.memory_error.search(text):
        return "memory"
    if exit_code == _SETUP_EXIT or (exit_code == 1 and text.startswith("prlimit:")):
        return "sandbox_error"
    return "runtime_error"
