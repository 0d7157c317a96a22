"""What the mesh handshake costs a rank per peer at start-up, on loopback.

Run: python bench/handshake.py [--connections 200] [--json PATH]

One listener serves `--connections` connections (in a thread, as a rank's
`Acceptor` does); the main thread times each connection from its start
until it may carry frames, two ways:

* handshake: `handshake.connect`, the mesh's connection (HELLO, CHALLENGE,
  PROOF, ACCEPTED: two round trips and four HMAC-SHA256);
* bare: a TCP connect and the 8-byte rank id ranks sent before the handshake
  existed (no round trip beyond TCP's own).

It prints the median and 90th percentile of each, in milliseconds; their
difference is the handshake's cost per peer (each rank pays it once for each
of its peers, on each of its two meshes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import median, percentile  # noqa: E402

from asynclock._core.base.backoff import Deadline  # noqa: E402
from asynclock._core.transports.handshake import Acceptor, MeshKey, connect  # noqa: E402

KEY = MeshKey(os.urandom(32), "bench.mailbox")
RANK_ID = struct.Struct("<q")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=200)
    p.add_argument("--json", type=Path, help="write the figures here too")
    return p.parse_args()


def timed(connections: int, serve: Callable[[socket.socket], None],
          open_one: Callable[[tuple[str, int], int], socket.socket]) -> list[float]:
    """Seconds per connection, from its start until it may carry frames."""
    with socket.create_server(("127.0.0.1", 0), backlog=connections) as listener:
        server = threading.Thread(target=serve, args=(listener,))
        server.start()
        address, walls, opened = listener.getsockname(), [], []
        for rank in range(1, connections + 1):
            t0 = time.perf_counter()
            opened.append(open_one(address, rank))
            walls.append(time.perf_counter() - t0)
        server.join(60)
        for sock in opened:
            sock.close()
    return walls


def with_handshake(connections: int) -> list[float]:
    def serve(listener: socket.socket) -> None:
        peers = Acceptor(listener, KEY, 0, set(range(1, connections + 1)), 10).run(Deadline(60))
        for sock in peers.values():
            sock.close()

    return timed(connections, serve, lambda address, rank: connect(
        address, KEY, rank, 0, Deadline(10)))


def bare(connections: int) -> list[float]:
    def serve(listener: socket.socket) -> None:
        for _ in range(connections):
            sock, _ = listener.accept()
            with sock:
                sock.recv(RANK_ID.size, socket.MSG_WAITALL)

    def open_one(address: tuple[str, int], rank: int) -> socket.socket:
        sock = socket.create_connection(address)
        sock.sendall(RANK_ID.pack(rank))
        return sock

    return timed(connections, serve, open_one)


def figures(walls: list[float]) -> dict[str, float]:
    ms = [1e3 * w for w in walls]
    return {"median_ms": median(ms), "p90_ms": percentile(ms, 0.9)}


def main() -> None:
    args = parse()
    bare(20), with_handshake(20)  # warm up: imports, first sockets
    out = {"connections": args.connections, "bare": figures(bare(args.connections)),
           "handshake": figures(with_handshake(args.connections))}
    out["cost_per_peer_ms"] = out["handshake"]["median_ms"] - out["bare"]["median_ms"]
    for name in ("bare", "handshake"):
        f = out[name]
        print(f"{name:>9}: median {f['median_ms']:.3f} ms, p90 {f['p90_ms']:.3f} ms "
              f"per connection ({args.connections})")
    print(f"handshake cost per peer: {out['cost_per_peer_ms']:.3f} ms (median)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
