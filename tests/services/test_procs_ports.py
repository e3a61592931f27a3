"""The test stacks' port picker (tests/services/procs.py): ports outside the kernel's ephemeral
range, one block per xdist worker, a bound port skipped, none handed out twice."""
from __future__ import annotations

import socket

from tests.services.procs import HOST, _port_block, _PortPicker


def test_worker_blocks_are_disjoint_and_below_the_ephemeral_range():
    blocks = [_port_block(f"gw{i}", 4, 32768) for i in range(4)]
    ports = [p for b in blocks for p in b]
    assert len(ports) == len(set(ports)) == 4 * 2000
    assert max(ports) < 32768 and min(ports) >= 20000
    assert _port_block("master", 1, 32768) == range(20000, 22000)


def test_no_block_when_the_ephemeral_range_starts_low():
    assert len(_port_block("gw0", 2, 20100)) == 0


def test_picker_skips_a_bound_port_and_never_repeats():
    block = _port_block("gw1", 2, 32768)
    picker = _PortPicker(block, start=0)
    first = picker.pick()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind((HOST, first + 1))  # the next port in the block, bound by someone else
        second = picker.pick()
    assert first in block and second in block
    assert second != first + 1 and second != first
    assert len({picker.pick() for _ in range(50)} | {first, second}) == 52


def test_picker_falls_back_to_the_kernel_without_a_block():
    picker = _PortPicker(range(0), start=0)
    ports = {picker.pick() for _ in range(5)}
    assert len(ports) == 5
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, ports.pop()))  # free when handed out
