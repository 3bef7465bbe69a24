"""Free ports: below the ephemeral range, free when handed out, and never handed out twice while reserved."""

import os
import socket
import subprocess
import sys
import time

from services.common import free_ports
from services.common.free_ports import free_port, port_in_use
from tests.cli_runner import REPO


def test_a_port_is_free_below_the_ephemeral_range_and_not_one_taken(tmp_path):
    low, _ = free_ports.ephemeral_range()
    taken = set()
    for _ in range(20):
        port = free_port(taken, folder=tmp_path)
        assert free_ports.LOWEST <= port < low and port not in taken and not port_in_use(port)
        taken.add(port)
    assert taken <= {int(p.name) for p in tmp_path.iterdir()}  # each one reserved


def test_a_reserved_port_is_not_handed_out_again_until_its_reservation_is_stale(tmp_path, monkeypatch):
    low = free_ports.LOWEST + 1000
    monkeypatch.setattr(free_ports, "ephemeral_range", lambda: (low, 60999))
    every = set(range(free_ports.LOWEST, low))
    for port in every:
        (tmp_path / str(port)).touch()  # reserved a moment ago, by other processes
    free = next(p for p in range(free_ports.LOWEST + 500, low) if not port_in_use(p))
    (tmp_path / str(free)).unlink()
    assert free_port(folder=tmp_path) == free
    # Every port of the range is reserved now: the OS picks one (from the ephemeral range) rather than reuse one.
    assert free_port(folder=tmp_path) >= low
    stale = time.time() - free_ports.RESERVE_S - 1
    os.utime(tmp_path / str(free), (stale, stale))
    assert free_port(folder=tmp_path) == free  # a stale reservation is taken over
    assert time.time() - (tmp_path / str(free)).stat().st_mtime < 60


def test_processes_picking_at_once_never_get_the_same_port(tmp_path):
    # 6 processes pick 20 ports each at the same moment, from a range of 1000: without the reservation
    # folder two would share a port in most runs (birthday bound: 1 - e^(-120*119/2000) ~ 100%).
    code = (
        "import sys, time\n"
        "from services.common import free_ports\n"
        f"free_ports.ephemeral_range = lambda: ({free_ports.LOWEST + 1000}, 60999)\n"
        "while time.time() < float(sys.argv[1]): time.sleep(0.001)\n"
        "print(*[free_ports.free_port(folder=__import__('pathlib').Path(sys.argv[2])) for _ in range(20)])\n"
    )
    start = str(time.time() + 2.0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, start, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        for _ in range(6)
    ]
    ports = [int(p) for proc in procs for p in proc.communicate(timeout=60)[0].split()]
    assert len(ports) == 120 and len(set(ports)) == 120


def test_without_a_folder_it_still_picks_a_free_port_and_an_unwritable_one_costs_only_the_reservation(tmp_path):
    assert not port_in_use(free_port(folder=None))
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert not port_in_use(free_port(folder=blocker / "ports"))


def test_the_launcher_and_the_tests_pick_through_it():
    from services.launcher.config import UpConfig
    from services.launcher.ports import allocate
    from tests.servers import free_port as tests_free_port

    low, _ = free_ports.ephemeral_range()
    ports = allocate(UpConfig(generators=2))
    every = [ports.redis, ports.prometheus, ports.trainer_grpc, ports.trainer_metrics, ports.controller]
    assert all(free_ports.LOWEST <= p < low for p in [*every, *ports.generator_metrics, *ports.generator_control])
    assert free_ports.LOWEST <= tests_free_port() < low


def test_a_port_in_use_is_passed_over(tmp_path, monkeypatch):
    low = free_ports.LOWEST + 1000
    monkeypatch.setattr(free_ports, "ephemeral_range", lambda: (low, 60999))
    for port in range(free_ports.LOWEST, low):
        (tmp_path / str(port)).touch()
    with socket.socket() as busy:  # the only unreserved port of the range is bound by someone
        port = next(p for p in range(free_ports.LOWEST, low) if not port_in_use(p))
        busy.bind(("127.0.0.1", port))
        (tmp_path / str(port)).unlink()
        assert free_port(folder=tmp_path) >= low


def test_stale_reservations_are_pruned_now_and_then(tmp_path, monkeypatch):
    stale = time.time() - free_ports.RESERVE_S - 1
    for port in (16001, 16002, 16003):
        (tmp_path / str(port)).touch()
        os.utime(tmp_path / str(port), (stale, stale))
    (tmp_path / "16004").touch()  # fresh: kept
    monkeypatch.setattr(free_ports, "PRUNE_CHANCE", 1.0)
    port = free_port(folder=tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"16004", str(port)}
