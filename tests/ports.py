"""Ports for servers a test starts and then polls, chosen below the kernel's ephemeral range.

A client connecting to a loopback port in the ephemeral range where nothing listens yet can
be given that very port as its own source port and connect to itself (TCP simultaneous
open): the request comes back as the answer, and while that socket lives the server that
was about to listen there cannot bind. A port below the range is never a source port."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_listen_ports(count: int = 1) -> int:
    """The first of `count` consecutive ports, all free on loopback, below the ephemeral
    range (a random start: tests running side by side rarely race for the same ports)."""
    low, high = 10_000, _ephemeral_low() - count
    for _ in range(1000):
        first = random.randint(low, high)
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports in [{low}, {high}]")
