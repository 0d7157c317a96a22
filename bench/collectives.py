"""Allreduce latency/bandwidth: asynclock vs raw mpi4py vs Horovod vs torch gloo.

Run: mpiexec -n 2 python bench/collectives.py [--json PATH] [--sizes 4,65536,...]
Every system runs in the same job on the same buffers (in place, sum), so
the ratios compare like with like. When Horovod is importable for this MPI,
`asynclock-hvd` is a second Coordinator on the Horovod backend in the same
job (headers over MPI, data stages over Horovod handles). Horovod starts only
after the other systems are timed, for every size: its background thread runs a
coordination cycle every millisecond, busy or idle, which takes CPU from every
system beside it where cores are few (figures: the benchmarks page). The Horovod rows
come with `mpi4py-beside-horovod`, raw MPI timed again while Horovod runs, and
every ratio is to raw MPI's first figure. Each figure is the median of several
rounds; each round times a batch of back-to-back calls sized to ~0.2 s, the
systems taking turns round by round.
Also reports the CPU a rank burns while awaiting a barrier that the other
rank enters 2 s late.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import torch
from mpi4py import MPI
from timing import Stopwatch, batch_size, median, per_call_async

import asynclock
from asynclock._core.runtime.coordinator import make_backend

WORLD = MPI.COMM_WORLD
SIZES = [4, 64 << 10, 4 << 20, 64 << 20]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", help="write the figures here (rank 0)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--round-seconds", type=float, default=0.2)
    p.add_argument("--skip-idle", action="store_true")
    p.add_argument("--fresh", action="store_true",
                   help="also time a new tensor per call (as a loop reducing each step's "
                        "loss does), for mpi4py and asynclock (in place, and an average "
                        "into a new tensor)")
    p.add_argument("--link", default=None,
                   help="label of the network between hosts (e.g. 5gbit); in every JSON row")
    return p.parse_args()


def agree_iters(seconds_per_call: float, budget: float) -> int:
    """Rank 0 decides how many calls a round makes; every rank must match."""
    return int(WORLD.bcast(batch_size(seconds_per_call, budget), root=0))


async def time_systems(fns: dict[str, Callable[[], Awaitable[Any]]],
                       args: argparse.Namespace) -> dict[str, float]:
    """Median seconds per call of each system, over synchronised rounds.

    The systems take turns round by round (not one after another), so a machine
    that slows down part-way through the run weighs on every system alike."""
    iters = {name: await _calibrate(fn, args) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            samples[name].append(await per_call_async(fn, iters[name], WORLD.Barrier))
    return {name: median(s) for name, s in samples.items()}


async def _calibrate(fn: Callable[[], Awaitable[Any]], args: argparse.Namespace) -> int:
    """Warm up, and agree on how many calls make one round of ~round_seconds."""
    return agree_iters(await per_call_async(fn, 3), args.round_seconds)


def sync_as_async(fn: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        return fn()
    return call


class Systems:
    """The peers measured side by side; each returns a per-call coroutine."""

    def __init__(self, coord: asynclock.Coordinator) -> None:
        self.coord = coord
        self.gloo = _init_gloo()
        self.hvd: Any = None
        self.hvd_coord: asynclock.Coordinator | None = None

    def start_horovod(self) -> bool:
        """Start Horovod and a coordinator on its backend (after the other systems'
        figures: Horovod's cycle takes CPU from everything beside it)."""
        self.hvd = _init_horovod()
        if self.hvd is not None:
            self.hvd_coord = asynclock.Coordinator(make_backend("horovod", WORLD))
        return self.hvd is not None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the Horovod-backed coordinator's engine next to the main one."""
        if self.hvd_coord is None:
            yield
            return
        async with self.hvd_coord.running():
            yield

    def close(self) -> None:
        """Tear peers down explicitly: a live gloo group aborts the process at exit."""
        if self.hvd_coord is not None:
            self.hvd_coord.shutdown()  # before Horovod itself: it does not own Horovod
        if self.gloo is not None:
            self.gloo.destroy_process_group()
        if self.hvd is not None:
            self.hvd.shutdown()

    def make(self, nbytes: int, fresh: bool = False) -> dict[str, Callable[[], Awaitable[Any]]]:
        """Every system; once Horovod is started, raw MPI and the two on Horovod only."""
        n = max(1, nbytes // 4)
        # Every system reduces torch-allocated memory, as training does: numpy asks
        # for huge pages on big arrays and torch does not, which alone moves a
        # 64 MiB allreduce by ~15% here, so mixing the two would not compare like
        # with like.
        arr = torch.zeros(n).numpy()
        t = torch.zeros(n)
        raw = sync_as_async(lambda: WORLD.Allreduce(MPI.IN_PLACE, arr))
        if self.hvd is not None:
            return self._horovod_systems(n, raw)
        out: dict[str, Callable[[], Awaitable[Any]]] = {
            "mpi4py": raw,
            "asynclock": lambda: self.coord.allreduce_(t),
        }
        if fresh:
            out["mpi4py-fresh"] = sync_as_async(
                lambda: WORLD.Allreduce(MPI.IN_PLACE, torch.zeros(n).numpy()))
            out["asynclock-fresh"] = lambda: self.coord.allreduce_(torch.zeros(n))
            out["asynclock-fresh-average"] = lambda: self.coord.allreduce(torch.zeros(n),
                                                                          "average")
        if self.gloo is not None:
            dist, gt = self.gloo, torch.zeros(n)
            out["torch-gloo"] = sync_as_async(lambda: dist.all_reduce(gt))
        return out

    def _horovod_systems(self, n: int, raw: Callable[[], Awaitable[Any]]
                         ) -> dict[str, Callable[[], Awaitable[Any]]]:
        hvd, ht = self.hvd, torch.zeros(n)
        out = {"mpi4py-beside-horovod": raw,
               "horovod": sync_as_async(lambda: hvd.allreduce_(ht, op=hvd.Sum))}
        if self.hvd_coord is not None:
            hc, hct = self.hvd_coord, torch.zeros(n)
            out["asynclock-hvd"] = lambda: hc.allreduce_(hct)
        return out


def _init_gloo() -> Any:
    """torch.distributed over gloo, rendezvous on a port rank 0 picked."""
    try:
        import socket

        import torch.distributed as dist
    except ImportError:
        return None
    hosts = WORLD.allgather(platform.node())
    port, addr = 0, "127.0.0.1"
    if WORLD.rank == 0:
        addr = rank0_address(hosts)
        with socket.socket() as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
    addr, port = WORLD.bcast((addr, port), root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}",
                            rank=WORLD.rank, world_size=WORLD.size)
    return dist


def rank0_address(hosts: list[str]) -> str:
    """An address of this host the other ranks can reach: loopback when every rank
    is here, this host's own address (from its name) when ranks run on other hosts."""
    import socket

    if len(set(hosts)) == 1:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def _init_horovod() -> Any:
    """Horovod sharing our MPI world, when it is installed for this MPI."""
    if os.environ.get("ASYNCLOCK_BENCH_HOROVOD", "1") == "0":
        return None
    if "Open MPI" not in MPI.Get_library_version():
        return None  # the installed Horovod links Open MPI: loading it here would mix MPIs
    try:
        import horovod.torch as hvd

        hvd.init(comm=WORLD)
    except Exception as exc:  # not built, or built for another MPI
        if WORLD.rank == 0:
            print(f"# horovod skipped: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        return None
    return hvd


async def idle_cpu(coord: asynclock.Coordinator, late_s: float = 2.0) -> dict[str, float]:
    """CPU fraction rank 0 burns while awaiting a barrier rank 1 enters late."""
    out = {}
    for system in ("asynclock", "mpi4py"):
        WORLD.Barrier()
        with Stopwatch() as sw:
            if coord.rank != 0:
                await anyio.sleep(late_s)
            if system == "asynclock":
                await coord.barrier()
            else:
                WORLD.Barrier()
        out[system] = sw.cpu / sw.wall if coord.rank == 0 else float("nan")
    return out


def render(rows: list[dict[str, Any]], idle: dict[str, float]) -> str:
    lines = [f"{'bytes':>10} {'system':<22} {'median':>12} {'ratio_to_raw':>12}"]
    for r in rows:
        lines.append(f"{r['bytes']:>10} {r['system']:<22} {_fmt(r['seconds_median']):>12} "
                     f"{r['ratio_to_raw']:>12.2f}")
    for system, frac in idle.items():
        lines.append(f"idle barrier wait, CPU of one core: {system:<10} {frac * 100:6.1f}%")
    return "\n".join(lines)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


async def _time_sizes(systems: Systems, sizes: list[int], args: argparse.Namespace,
                      raw: dict[int, float]) -> list[dict[str, Any]]:
    """Rows for every size; `raw` holds (and, on the first pass, gets) raw MPI's median
    per size, which every ratio is to."""
    rows: list[dict[str, Any]] = []
    for nbytes in sizes:
        medians = await time_systems(systems.make(nbytes, args.fresh), args)
        base = raw.setdefault(nbytes, medians.get("mpi4py", 0.0))
        rows += [{"system": k, "bytes": nbytes, "seconds_median": v,
                  "ratio_to_raw": v / base, "link": args.link} for k, v in medians.items()]
    return rows


async def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    async with asynclock.start() as coord:
        systems = Systems(coord)
        sizes = [int(s) for s in args.sizes.split(",")]
        raw: dict[int, float] = {}
        rows = await _time_sizes(systems, sizes, args, raw)
        idle = {} if args.skip_idle else await idle_cpu(coord)
        bulk = getattr(coord.backend, "bulk_choice", "")
        windows = getattr(coord.backend, "window_calls", lambda: 0)()
        if systems.start_horovod():
            async with systems.running():
                rows += await _time_sizes(systems, sizes, args, raw)
        systems.close()
    if WORLD.rank == 0:
        print(f"# {WORLD.size} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"{platform.node()}; asynclock bulk allreduces: {bulk or 'n/a'}; "
              f"{windows} through the node window")
        print(render(rows, idle))
        if args.json:
            meta = {"mpi": MPI.Get_library_version().splitlines()[0].strip(), "ranks": WORLD.size,
                    "link": args.link, "bulk": bulk, "window_calls": windows}
            with open(args.json, "w") as fh:
                json.dump({"meta": meta, "rows": rows, "idle_cpu_fraction": idle}, fh, indent=1)


if __name__ == "__main__":
    anyio.run(main)
