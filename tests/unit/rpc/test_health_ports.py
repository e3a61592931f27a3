"""rpc/health.py free_ports: the ports `specsplit up` gives its engines are distinct, free, and
never the gateway's (two services told one port: the second cannot bind, the first answers the
health checks meant for it)."""
from __future__ import annotations

import socket

from specsplit.rpc.health import free_port, free_ports


def test_free_ports_are_distinct_free_and_avoid_what_is_asked():
    taken = free_port()
    for _ in range(50):  # the kernel hands just-closed ports out again: many draws, never a repeat
        ports = free_ports(3, avoid=[taken])
        assert len(set(ports)) == 3 and taken not in ports
    for port in free_ports(2):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # free: it binds
