"""Port allocation: fixed ports checked before anything starts, free ones distinct."""

import socket

import pytest

from services.launcher.config import UpConfig
from services.launcher.ports import PortError, allocate, port_in_use


def _listening() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _two_free_in_a_row() -> int:
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base < 65535 and not port_in_use(base + 1):
            return base


def test_free_ports_are_distinct_and_fixed_ones_are_kept():
    ports = allocate(UpConfig(generators=3))
    every = [ports.redis, ports.prometheus, ports.trainer_grpc, ports.trainer_metrics, ports.controller]
    every += [*ports.generator_metrics, *ports.generator_control]
    assert len(set(every)) == len(every) == 11 and all(p > 0 for p in every)
    base = _two_free_in_a_row()
    fixed = allocate(UpConfig(generators=2, ports={"generator_metrics": base}))
    assert fixed.generator_metrics == (base, base + 1)
    assert base not in fixed.generator_control and base + 1 not in fixed.generator_control


def test_a_fixed_port_in_use_is_an_error_naming_it():
    with _listening() as busy:
        port = busy.getsockname()[1]
        assert port_in_use(port)
        with pytest.raises(PortError, match=rf"port {port} \(redis\) is in use"):
            allocate(UpConfig(ports={"redis": port}))
        # A Redis given by URL is not started, so its port is nobody's business here.
        allocate(UpConfig(redis_url="redis://127.0.0.1:1/0", ports={"redis": port}))


def test_the_same_port_for_two_services_is_an_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(PortError, match=f"port {port} is configured for both trainer_grpc and trainer_metrics"):
        allocate(UpConfig(ports={"trainer_grpc": port, "trainer_metrics": port}))


def test_no_controller_port_without_a_controller():
    assert allocate(UpConfig(generator={"engine": {"decode": "dense"}})).controller == 0
    assert allocate(UpConfig(with_controller=False)).controller == 0
