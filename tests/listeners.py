"""Which TCP listeners a job's processes hold, read from /proc as the kernel sees them.

A listener belongs to the process that holds its socket: /proc/<pid>/fd links
name each socket's inode, and /proc/<pid>/net/tcp{,6} list the listening ones
(state 0A) with their inode, address and port. Tests use it to say what a job
opens to its host's network (tests/test_network_trust.py); bench/crowd.py uses
it to hold connections open on every port a job listens on.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"  # TCP_LISTEN, as /proc/net/tcp writes a socket's state


@dataclass(frozen=True)
class Listener:
    pid: int
    name: str  # the process's comm
    address: str  # as an IP address: 0.0.0.0 and :: are every interface
    port: int
    inode: int

    def row(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.name} (pid {self.pid}) {host}:{self.port}"


def _address(hex_host: str) -> str:
    """/proc/net/tcp's host field: IPv4 as one little-endian word, IPv6 as four."""
    raw = bytes.fromhex(hex_host)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    v6 = ipaddress.IPv6Address(words)
    return str(v6.ipv4_mapped or v6)


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets `pid` holds now (empty once it is gone)."""
    found = set()
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in entries:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def listening_sockets(pid: int) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in `pid`'s network
    namespace."""
    found: dict[int, tuple[str, int]] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            host, port = fields[1].split(":")
            found[int(fields[9])] = (_address(host), int(port, 16))
    return found


def children(pid: int) -> list[int]:
    """Every live descendant of `pid`."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def without_launcher(pids: list[int]) -> list[int]:
    """`pids` but horovodrun's own process, whose rendezvous server is the launcher's,
    not a rank's."""
    return [pid for pid in pids if _comm(pid) != "horovodrun"]


def _namespace(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


def listeners(pids: list[int]) -> list[Listener]:
    """The listeners held by `pids` and all their descendants (each network
    namespace's tables read once)."""
    found: list[Listener] = []
    tables: dict[str, dict[int, tuple[str, int]]] = {}
    for pid in sorted({*pids, *(c for p in pids for c in children(p))}):
        inodes = socket_inodes(pid)
        if not inodes:
            continue
        space = _namespace(pid)
        if space not in tables:
            tables[space] = listening_sockets(pid)
        table = tables[space]
        for inode in sorted(inodes & table.keys()):
            address, port = table[inode]
            found.append(Listener(pid, _comm(pid), address, port, inode))
    return found
