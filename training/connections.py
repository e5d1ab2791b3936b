"""Ending a collective that waits on a silent peer now, not after the grace window.

Gloo has no abort that wakes a rank blocked on a peer that neither answers nor closes (a cut
link, a frozen host): the rank waits out the group's timeout. A peer's exit ends the wait at
once, because its sockets close; shutting down the rank's own end of its gloo connections does
the same from this side. A rank records the addresses its groups listen on as it forms them
(`listening`); the driver, once a peer is found unreachable, hands every rank's addresses to
the others, which `sever` their connections to and from them: the blocked collective fails as
if the peer had gone, and the survivors re-form. Linux only (read from /proc); elsewhere
nothing is found and the grace window stands.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Address", "listening", "sever"]

Address = tuple[str, int]
"""An IP address (v4 where a v6 one maps one) and a port."""

_LISTEN, _ESTABLISHED = "0A", "01"


@dataclass(frozen=True)
class _Conn:
    local: Address
    remote: Address
    state: str
    inode: int


def _address(text: str) -> Address:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # the kernel prints each 32-bit word in host (little-endian) order
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(packed)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def _table() -> Iterator[_Conn]:
    for name in ("tcp", "tcp6"):
        path = Path("/proc/self/net") / name
        try:
            lines = path.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            yield _Conn(_address(f[1]), _address(f[2]), f[3], int(f[9]))


def _fds() -> dict[int, int]:
    """This process's socket file descriptors by inode."""
    out: dict[int, int] = {}
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for entry in entries:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{entry}")
            if target.startswith("socket:["):
                out[int(target[8:-1])] = int(entry)
    return out


def listening() -> frozenset[Address]:
    """The addresses this process listens on (a diff around forming the groups gives
    theirs)."""
    mine = _fds()
    return frozenset(c.local for c in _table() if c.state == _LISTEN and c.inode in mine)


def sever(listeners: Collection[Address], own: Collection[Address]) -> int:
    """Shut down this process's connections to any of `listeners` (every rank's group
    addresses) and those accepted on `own` (this rank's): a collective blocked on them fails
    now. The number shut down."""
    to = {a for a in listeners if not ipaddress.ip_address(a[0]).is_unspecified}
    any_host = {port for host, port in listeners if ipaddress.ip_address(host).is_unspecified}
    ports = {port for _, port in own}
    mine = _fds()
    done = 0
    for c in _table():
        fd = mine.get(c.inode)
        if fd is None or c.state != _ESTABLISHED:
            continue
        if c.remote in to or c.remote[1] in any_host or c.local[1] in ports:
            with contextlib.suppress(OSError):
                s = socket.socket(fileno=os.dup(fd))
                try:
                    s.shutdown(socket.SHUT_RDWR)  # the socket itself, not only this fd
                    done += 1
                finally:
                    s.close()
    return done
