"""Bulk allreduces across hosts over gloo, torch's own TCP collectives.

Why: between hosts connected by TCP, MPI's blocking Allreduce spins a core
for as long as the wire is busy, and its large-message path is slower than
gloo's pipelined ring, whose thread sleeps in the kernel until data arrives
(figures across two emulated hosts: the benchmarks page). So when a
channel's ranks span hosts and the program uses torch, asynclock hands the
allreduces its wait thread runs (all of them where MPI's call spins, else from a
measured size on) to a private gloo group. Everything else stays on MPI: the
header round that checks and orders every call comes first, so gloo sees
the calls in the same order on every rank, one at a time per channel.

The group is asynclock's own (`ProcessGroupGloo` on a private `TCPStore`),
not `torch.distributed`'s default group, so a program's own DDP or
`init_process_group` is untouched. Setting it up is collective and agreed:
if any rank cannot (no torch, an unreachable address), no rank uses gloo.

Not every cluster is TCP: where MPI runs over InfiniBand, gloo (TCP over
IPoIB) would be far slower. So `auto` measures before it chooses: the
first channel times 4 MiB (the gradient bucket cap) and 16 MiB allreduces
both ways (5 each after one untimed call, every rank; alone and beside a
compute load, and the process's CPU time alone) and takes the slowest rank's
figures, identical on every rank, so the choice is too. Where MPI's blocking
allreduce spins (its CPU time alone is half its wall time or more, as over TCP)
and gloo alone is at most twice as slow, gloo takes every allreduce the wait
thread runs: no wait thread then spins a core on a gradient bucket of any size.
Otherwise gloo takes allreduces from the smallest size at which it beats MPI by
10% beside the compute load, or is at most 10% slower there with 3/4 of MPI's
CPU or less, and is alone at most twice as slow (not at all if at none).
`ASYNCLOCK_BULK`: `auto` (measured, across hosts only), `measure` (measured,
also within a node), `gloo` (always, e.g. to test it on one node), `mpi` (never).
`MPIBackend.bulk_choice` says what was chosen and why.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ..base import settings
from ..base.ops import ReduceOp
from .process_group import PGGroup, PGStore, agreed, backend_usable

Array = np.ndarray[Any, Any]
GLOO_DTYPES = frozenset({"float32", "float64", "int32", "int64"})
# Without a probe (ASYNCLOCK_BULK=gloo) gloo takes allreduces from ASYNCLOCK_GLOO_MIN_BYTES,
# 16 MiB by default: over TCP it beats MPICH only from there (Open MPI from smaller sizes;
# figures on the benchmarks page).


def mode() -> str:
    return settings.text("ASYNCLOCK_BULK")


def gloo_min_bytes() -> int:
    """Without a probe (ASYNCLOCK_BULK=gloo): the smallest allreduce gloo takes."""
    return int(settings.number("ASYNCLOCK_GLOO_MIN_BYTES"))


class GlooStore(PGStore):
    """The backend's store (`process_group`), with the size from which gloo takes
    allreduces; a gloo group per channel."""

    def __init__(self, store: Any, rank: int, size: int) -> None:
        super().__init__(store, rank, size)
        self.min_bytes: int | None = gloo_min_bytes()  # the probe may lower it

    @classmethod
    def connect(cls, comm: Any, spans: bool) -> tuple[GlooStore | None, str]:
        """Collective over `comm` (whose ranks span hosts if `spans`): a store
        every rank reached (or None on all), and why (`MPIBackend.bulk_choice`)."""
        if mode() == "mpi" or (mode() == "auto" and not spans):  # "measure": probe anyway
            return None, f"mpi ({'ASYNCLOCK_BULK=mpi' if mode() == 'mpi' else 'one node'})"
        if not agreed(comm, backend_usable("gloo")):
            return None, "mpi (torch with gloo not imported on every rank)"
        store, why = PGStore.open(comm, spans)
        if store is None:
            return None, f"mpi ({why})"
        made = cls(store, comm.Get_rank(), comm.Get_size())
        if mode() == "gloo":
            return made, "gloo (ASYNCLOCK_BULK=gloo)"
        made.min_bytes, choice = _probe(comm, made.bulk_group("probe"))
        return (made if made.min_bytes is not None else None), choice

    def bulk_group(self, name: str) -> GlooGroup:
        """A channel's bulk allreduce group (connected on its first allreduce)."""
        return GlooGroup(self, self.group(name, "gloo"))


PROBE_SIZES = (4 << 20, 16 << 20)  # the bucket cap, and a large user tensor
PROBE_REPS = 5
PROBE_MARGIN = 0.9  # beside compute, gloo must be 10% faster...
ALONE_SLACK = 2.0  # ... and alone at most twice as slow (a call nothing overlaps);
CPU_SHARE = 0.75  # or use at most 3/4 of MPI's CPU time alone...
PROBE_TIE = 1.1  # ... while beside compute at most 10% slower
SPIN_SHARE = 0.5  # a blocking call whose thread runs or waits to run for half its
                  # wall time or more spins
CHUNK = 128  # the probe's compute load: 128x128 matmuls, small steps to match a call's length


def _probe(comm: Any, group: GlooGroup) -> tuple[int | None, str]:
    """Time MPI's and gloo's allreduce at each probe size, alone and beside a
    compute load; the slowest rank's medians decide the smallest size from
    which gloo is used (None: never).

    Beside compute, because that is how gradient buckets run: over TCP, MPI's
    blocking allreduce spins a core for as long as the wire is busy, gloo's
    threads mostly wait in the kernel. Where the rank has a spare core the spin
    costs nothing and MPI's often faster wire time wins; where it has none the
    spin takes the core from the compute it overlaps. An idle-machine probe
    cannot tell the two apart: where hosts have no spare core it can choose
    MPI for bucket-sized allreduces, whose spinning wait thread then takes
    the core backward needs (figures on the benchmarks page).

    A short probe load can still hide the spin: both calls then end with the
    load, and beside compute they look alike. The CPU time each call takes
    alone (every thread of the process) shows it: MPI's spin takes a core for
    the whole call, gloo's threads a fraction of one. A path that is no faster
    beside compute but takes 3/4 of the CPU or less is chosen for that reason.
    Whether MPI's call spins is read from its calling thread's run and run-queue
    time (`_runnable`), which a loaded machine does not hide.

    Blocking, once, while the coordinator starts (like its communicator dups)."""
    from mpi4py import MPI

    _warm(comm, group)
    mine = np.array([_costs(comm, group, n) for n in PROBE_SIZES])
    worst = np.empty_like(mine)
    comm.Allreduce(mine, worst, op=MPI.MAX)
    figures = "; ".join(f"{n >> 20} MiB: gloo {1e3 * ga:.1f} ms (beside compute "
                        f"{1e3 * gb:.1f}, CPU {1e3 * gc:.1f}), MPI {1e3 * ma:.1f} ms (beside "
                        f"compute {1e3 * mb:.1f}, CPU {1e3 * mc:.1f}, runnable {1e3 * mr:.1f})"
                        for n, (ma, ga, mb, gb, mc, gc, mr)
                        in zip(PROBE_SIZES, worst, strict=True))
    min_bytes = _decide([list(map(float, row)) for row in worst])
    if min_bytes is None:
        return None, f"mpi (allreduce {figures})"
    if min_bytes == 0:
        return 0, f"gloo for every bulk allreduce: MPI's spins (allreduce {figures})"
    return min_bytes, f"gloo from {min_bytes >> 20} MiB (allreduce {figures})"


def _decide(rows: list[list[float]]) -> int | None:
    """From the slowest rank's `_costs` at each of PROBE_SIZES: the smallest allreduce
    gloo takes (0: every one the wait thread runs; None: none).

    A wait thread in MPI's blocking allreduce that spins takes a core for the whole
    call, whatever its size; gloo's wait sleeps in the kernel. So where MPI's call
    spins at the bucket size (its calling thread runnable, `_spins`) and gloo alone
    is at most `ALONE_SLACK` times slower,
    gloo takes every bulk allreduce. Otherwise (MPI's call sleeps, or gloo is far
    slower, as TCP over IPoIB against InfiniBand) gloo takes allreduces only from
    the smallest probed size at which it wins (`_gloo_wins`), if any."""
    mpi_alone, gloo_alone, *_, mpi_runnable = rows[0]
    if _spins(mpi_alone, mpi_runnable) and gloo_alone <= ALONE_SLACK * mpi_alone:
        return 0
    wins = [n for n, row in zip(PROBE_SIZES, rows, strict=True) if _gloo_wins(*row[:6])]
    return wins[0] if wins else None


def _spins(wall: float, runnable: float) -> bool:
    """A call alone whose thread is on a CPU or waiting for one for `SPIN_SHARE` of
    its time or more is polling, not sleeping. On a loaded machine a polling thread
    gets a share of a core, not all of it: its CPU time alone would read as sleeping,
    its run-queue wait makes up the rest."""
    return runnable >= SPIN_SHARE * wall


def _gloo_wins(mpi_alone: float, gloo_alone: float, mpi_beside: float, gloo_beside: float,
               mpi_cpu: float, gloo_cpu: float) -> bool:
    """Alone no more than twice as slow, and beside compute either 10% faster, or at
    most 10% slower with 3/4 of MPI's CPU time or less."""
    faster = gloo_beside < PROBE_MARGIN * mpi_beside
    lighter = gloo_cpu <= CPU_SHARE * mpi_cpu and gloo_beside <= PROBE_TIE * mpi_beside
    return (faster or lighter) and gloo_alone <= ALONE_SLACK * mpi_alone


def _warm(comm: Any, group: GlooGroup) -> None:
    """One untimed call each way first: gloo connects its pairs on its first call, and
    a new TCP connection starts slow (slow start, small windows): a median over a
    few calls should see neither."""
    from mpi4py import MPI

    data = np.ones(PROBE_SIZES[0] // 4, np.float32)
    comm.Allreduce(MPI.IN_PLACE, data)
    group.allreduce(data, ReduceOp.SUM)


def _costs(comm: Any, group: GlooGroup, nbytes: int) -> list[float]:
    """[MPI alone, gloo alone, MPI beside compute, gloo beside compute, MPI's CPU
    alone, gloo's CPU alone, MPI's calling thread runnable alone]: median seconds
    per call (beside: until both the call and the load are done; CPU: the
    process's, every thread; runnable: `_runnable`). Every rank makes the same
    calls in the same order; only the loads differ."""
    from mpi4py import MPI

    data = np.ones(nbytes // 4, np.float32)

    def mpi() -> None:
        comm.Allreduce(MPI.IN_PLACE, data)

    def gloo() -> None:
        group.allreduce(data, ReduceOp.SUM)

    (mpi_alone, mpi_cpu, mpi_runnable) = _medians(mpi)
    (gloo_alone, gloo_cpu, _) = _medians(gloo)
    load = _Load(mpi_alone)
    return [mpi_alone, gloo_alone, _medians(lambda: load.beside(mpi))[0],
            _medians(lambda: load.beside(gloo))[0], mpi_cpu, gloo_cpu, mpi_runnable]


def _medians(fn: Any) -> tuple[float, float, float]:
    """Median wall seconds, process CPU seconds and calling-thread runnable
    seconds (`_runnable`) of `fn()` over PROBE_REPS calls."""
    walls, cpus, runnables = [], [], []
    for _ in range(PROBE_REPS):
        t0, c0, r0 = time.perf_counter(), time.process_time(), _runnable()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        runnables.append(_runnable() - r0)
    return _median(walls), _median(cpus), _median(runnables)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _runnable() -> float:
    """Seconds the calling thread has spent on a CPU or in the run queue waiting for
    one (Linux's schedstat); where the kernel does not say, its CPU time alone."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            on_cpu, waiting, _slices = stat.read().split()
    except (OSError, ValueError):
        return time.thread_time()
    return (int(on_cpu) + int(waiting)) / 1e9


class _Load:
    """About `seconds` of torch compute (the program's intra-op threads), run in a
    thread beside a collective: what a spinning wait costs the work it overlaps."""

    def __init__(self, seconds: float, chunk_seconds: float | None = None) -> None:
        import torch

        self.a = torch.ones(CHUNK, CHUNK)
        chunk_seconds = self._chunk_seconds() if chunk_seconds is None else chunk_seconds
        self.chunks = max(1, round(seconds / chunk_seconds))
        self.done = 0  # chunks run by the last `beside`

    def _chunk_seconds(self) -> float:
        import torch

        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            torch.mm(self.a, self.a)
            times.append(time.perf_counter() - t0)
        return max(min(times), 1e-6)

    def _run(self) -> None:
        import torch

        self.done = 0
        for _ in range(self.chunks):
            torch.mm(self.a, self.a)
            self.done += 1

    def beside(self, fn: Any) -> None:
        """Run `fn()` here while the load runs in a thread; return when both are done."""
        worker = threading.Thread(target=self._run, name="asynclock-probe-load")
        worker.start()
        try:
            fn()
        finally:
            worker.join()


class GlooGroup:
    """A channel's bulk allreduce, blocking in the kernel (not spinning).

    Its connections are made on the first allreduce, in the channel's wait
    thread (each channel has its own, and its calls come in agreed order), so
    channels that never move 16 MiB at once never connect."""

    def __init__(self, store: GlooStore, group: PGGroup) -> None:
        self.store, self.group = store, group

    @property
    def calls(self) -> int:
        return self.group.calls

    def handles(self, data: Array, op: ReduceOp) -> bool:
        """Large enough to gain (measured: `_probe`), in a dtype gloo sums."""
        return (data.nbytes >= (self.store.min_bytes or 0) and data.dtype.name in GLOO_DTYPES
                and data.flags.c_contiguous)

    def allreduce(self, data: Array, op: ReduceOp, send: Array | None = None) -> None:
        """Reduce into `data` (from `send` when given; AVERAGE sums, the caller divides)."""
        import torch

        if send is not None:
            data[...] = send
        self.group.allreduce(torch.from_numpy(data.reshape(-1)), op)
