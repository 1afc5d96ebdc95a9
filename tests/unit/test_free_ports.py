"""The embedded servers' ports: never one a client socket's local port can take meanwhile."""

from __future__ import annotations

import socket

import pytest

from xpupool.devstack import servers
from xpupool.devstack.servers import _ephemeral_range, free_ports


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    ephemeral = _ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        assert port not in ephemeral
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", free_ports(1)[0]))
        held.listen()
        taken = held.getsockname()[1]
        # A candidate range of five ports, the held one among them: a pick that did not check
        # would hand it out about once in five.
        monkeypatch.setattr(servers, "_PORTS_BELOW_EPHEMERAL", range(taken - 2, taken + 3))
        for _ in range(50):
            assert taken not in servers.free_ports(1)
