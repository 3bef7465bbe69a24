"""Free loopback ports that stay free until the service they are for binds them.

A port the OS picks (a bind to port 0) comes from the ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999 by default), where every outgoing connection's
local port comes from too. Between the moment a launcher picks a port and the moment its service binds
it (seconds: the service imports torch first), any client on the machine may take it; a trainer once
failed to start on a /metrics port taken that way while another run's clients connected beside it.

So a port is picked below the ephemeral range (from a random one on), checked free by binding it, and reserved for
RESERVE_S in a folder every process of the machine sees (`sparrow.disk_cache`'s, one file per port,
created exclusively): two launchers, or two tests, picking at the same moment never get the same port.
With the cache turned off the reservation is skipped and the random pick with its check remains.
"""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

HOST = "127.0.0.1"
LOWEST = 15000  # below: the well-known and commonly configured service ports
RESERVE_S = 600.0  # a service binds its port well within this after the pick
PRUNE_CHANCE = 0.02  # one pick in 50 also deletes the stale reservations (a folder never grows past the ports in use)
EPHEMERAL_DEFAULT = (32768, 60999)

_random = random.Random()  # seeded from os.urandom: processes started together pick differently


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (connect, bind to 0), inclusive."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def port_in_use(port: int, host: str = HOST) -> bool:
    """True when `port` cannot be bound on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_port(taken: set[int] | frozenset[int] = frozenset(), host: str = HOST, folder: Path | None = None) -> int:
    """A port free on `host` now, not in `taken`, outside the ephemeral range, and reserved for this caller.

    `folder`: where reservations live (default: `sparrow.disk_cache`'s folder, `ports/` in it; none when
    the cache is off). Falls back to a port the OS picks when the range below the ephemeral one is small (a
    machine configured so) or every port there is reserved or in use."""
    low, _ = ephemeral_range()
    if folder is None:
        from sparrow.disk_cache import cache_folder

        base = cache_folder()
        folder = None if base is None else base / "ports"
    if folder is not None and _random.random() < PRUNE_CHANCE:
        prune(folder)
    span = low - LOWEST
    if span >= 1000:
        start = _random.randrange(span)  # from a random port on, every port of the range once
        for i in range(span):
            port = LOWEST + (start + i) % span
            if port in taken or not _reserve(folder, port):
                continue
            if not port_in_use(port, host):
                return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port


def prune(folder: Path) -> int:
    """Delete the reservations older than RESERVE_S in `folder`; how many went."""
    gone = 0
    try:
        entries = list(folder.iterdir())
    except OSError:
        return 0
    now = time.time()
    for path in entries:
        try:
            if now - path.stat().st_mtime >= RESERVE_S:
                path.unlink()
                gone += 1
        except OSError:
            pass  # another process pruned or took it over first
    return gone


def _reserve(folder: Path | None, port: int) -> bool:
    """Whether this caller now holds `port`'s reservation: no other was made in the last RESERVE_S."""
    if folder is None:
        return True
    path = folder / str(port)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if time.time() - path.stat().st_mtime < RESERVE_S:
            return False
        # Stale: one caller moves it aside (a rename succeeds once), then the exclusive create decides.
        os.rename(path, folder / f".{port}.{os.getpid()}.stale")
        os.unlink(folder / f".{port}.{os.getpid()}.stale")
    except FileNotFoundError:
        pass
    except OSError:
        return True  # an unwritable folder costs only the reservation
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True
