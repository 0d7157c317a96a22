"""The MPI transport: mpi4py non-blocking collectives on duplicated communicators."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..base import settings
from ..base.header import COMPACT_BYTES, NUMPY_FOLDS, combine
from ..base.ops import HALF_CODES, ReduceOp
from .base import Array, Deferred, Request, close_channel_of
from .gloo_bulk import GlooGroup, GlooStore
from .gloo_bulk import mode as gloo_mode
from .heartbeat import MPIHeartbeats
from .node_segment import NodeSegment
from .node_segment import make as make_segment
from .node_window import NodeWindow
from .process_group import DevicePath, PGGroup, PGStore, choose_device_path
from .ring import ring_allreduce_half
from .settle import settle

_MPI: list[Any] = []  # mpi4py's MPI module once imported; `_OPS` its ops by ReduceOp


def _mpi() -> Any:
    """Import mpi4py lazily: `import asynclock` must not initialise MPI."""
    if not _MPI:
        from mpi4py import MPI

        _MPI.append(MPI)
    return _MPI[0]


def _in_place(send: Array | None, recv: Array) -> Any:
    """MPI_IN_PLACE, with `send` copied into `recv` first.

    MPI asks for the in-place form at every rank or at none, and ranks differ
    here (`allreduce_` on one, `allreduce` on another; a joined rank standing
    in): Open MPI's non-blocking allreduce at 4 ranks truncates messages when
    they mix. MPICH and Open MPI copy `send` into `recv` first themselves, so
    the copy here costs nothing extra.
    """
    if send is not None:
        recv.reshape(-1)[...] = send.reshape(-1)
    return _mpi().IN_PLACE


_OPS: dict[ReduceOp, Any] = {}


def _mpi_op(op: ReduceOp) -> Any:
    if not _OPS:
        MPI = _mpi()
        _OPS.update({ReduceOp.SUM: MPI.SUM, ReduceOp.AVERAGE: MPI.SUM, ReduceOp.MIN: MPI.MIN,
                     ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD})
    return _OPS[op]


_P2P_TAG = 7
_COMPACT: list[tuple[Any, Any]] = []  # (datatype, op), made once per process


def _compact_op() -> tuple[Any, Any]:
    """One COMPACT_BYTES element, reduced by `header.combine` in rank order."""
    if not _COMPACT:
        MPI = _mpi()
        kind = MPI.BYTE.Create_contiguous(COMPACT_BYTES).Commit()

        def reduce(lower: Any, inout: Any, datatype: Any) -> None:
            n = len(memoryview(inout)) // COMPACT_BYTES
            a = np.frombuffer(lower, np.int64).reshape(n, -1)
            b = np.frombuffer(inout, np.int64).reshape(n, -1)
            for i in range(n):
                combine(a[i], b[i])

        _COMPACT.append((kind, MPI.Op.Create(reduce, commute=False)))
    return _COMPACT[0]


def _displs(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def _bytes(arr: Array) -> Array:
    """Data that is only moved, not reduced, travels as bytes: no MPI datatype
    is needed for float16 or bfloat16 (Open MPI 4 has none)."""
    return arr.view(np.uint8)


def _scaled(counts: list[int], arr: Array) -> list[int]:
    size = arr.itemsize
    return counts if size == 1 else [c * size for c in counts]


class MPIChannel:
    """One subsystem's private header and data communicators."""

    def __init__(self, world: Any, name: str, gloo: GlooStore | None = None,
                 device: PGStore | None = None, device_backend: str | None = None,
                 one_node: bool = False) -> None:
        self.name = name
        self.hdr = world.Dup()  # the compact header rounds (and Ibarrier)
        self.rows = world.Dup()  # the rows rounds, which follow in header order
        self.data = world.Dup()
        self.p2p = world.Dup()
        self.bulk = world.Dup()
        self.bulk.Set_name(f"asynclock.{name}.bulk")
        self.hdr.Set_name(f"asynclock.{name}.hdr")
        self.rows.Set_name(f"asynclock.{name}.rows")
        self.data.Set_name(f"asynclock.{name}.data")
        self.p2p.Set_name(f"asynclock.{name}.p2p")
        self._status = _mpi().Status()
        self.rank = world.Get_rank()
        self.size = world.Get_size()
        self._bulk_view = BulkChannel(self, gloo.bulk_group(name) if gloo is not None else None)
        self.loop_band = _loop_band(one_node)
        self._node_data: Any = None  # `use_node_data`
        # CUDA tensors' data stages (`engine.device_pg`): NCCL, or gloo in its CPU twin
        self.device_group: PGGroup | None = None
        if device is not None and device_backend is not None:
            self.device_group = device.channel_group(name, device_backend, self.rank, self.size)

    compact = True  # header rounds: `iallreduce_compact`, then rows when asked

    def iallgather_slots(self, send: Array, recv: Array) -> Request:
        return self.rows.Iallgather(send, recv)  # type: ignore[no-any-return]

    def iallreduce_compact(self, send: Array, recv: Array) -> Request:
        """The compact header round with mpi4py's op (`engine.fastpath` has a C one)."""
        kind, op = _compact_op()
        return self.hdr.Iallreduce([send, kind], [recv, kind], op)  # type: ignore[no-any-return]

    def node_segment(self, wanted: bool, rank_bytes: int) -> NodeSegment | None:
        """Collective: shared memory for the compact round where every rank of the
        channel is on one node and wants it (`node_segment`)."""
        return make_segment(self.hdr, wanted, rank_bytes)

    def use_node_data(self, node: Any) -> None:
        """Take allreduces that fit `node` (a C `NodeData`, made by the engine where every
        rank of the channel is on one node) through the node's shared memory."""
        self._node_data = node

    def iallreduce(self, send: Array | None, recv: Array, op: ReduceOp) -> Request:
        node = self._node_data
        if node is not None and type(recv) is np.ndarray and 0 < recv.nbytes <= node.slot:
            # decided from agreed facts only (size, dtype, op): every rank goes alike
            fold = NUMPY_FOLDS.get((recv.dtype, ReduceOp.SUM if op is ReduceOp.AVERAGE else op))
            if fold is not None:
                return node.start(recv if send is None else send, recv, fold)  # type: ignore[no-any-return]
        return self.data.Iallreduce(  # type: ignore[no-any-return]
            _in_place(send, recv), recv, _mpi_op(op))

    def ibcast(self, buf: Array, root: int) -> Request:
        return self.data.Ibcast(_bytes(buf), root)  # type: ignore[no-any-return]

    def iallgatherv(self, send: Array, recv: Array, counts: list[int]) -> Request:
        counts = _scaled(counts, recv)
        return self.data.Iallgatherv(  # type: ignore[no-any-return]
            _bytes(send), [_bytes(recv), (counts, _displs(counts))])

    def ireduce_scatter(self, send: Array, recv: Array, counts: list[int],
                        op: ReduceOp) -> Request:
        return self.data.Ireduce_scatter(send, recv, counts, _mpi_op(op))  # type: ignore[no-any-return]

    def ialltoall(self, send: Array, recv: Array) -> Request:
        return self.data.Ialltoall(send, recv)  # type: ignore[no-any-return]

    def ialltoallv(self, send: Array, scounts: list[int], recv: Array,
                   rcounts: list[int]) -> Request:
        scounts, rcounts = _scaled(scounts, send), _scaled(rcounts, recv)
        return self.data.Ialltoallv(  # type: ignore[no-any-return]
            [_bytes(send), (scounts, _displs(scounts))],
            [_bytes(recv), (rcounts, _displs(rcounts))])

    def ibarrier(self) -> Request:
        return self.hdr.Ibarrier()  # type: ignore[no-any-return]

    def bulk_view(self) -> BulkChannel:
        return self._bulk_view

    def p2p_isend(self, buf: Array, dest: int) -> Request:
        return self.p2p.Isend(buf, dest, _P2P_TAG)  # type: ignore[no-any-return]

    def p2p_try_recv(self, buf: Array) -> tuple[int, int] | None:
        """Iprobe then Recv: the loop thread is the only receiver on `p2p`, so
        the probed message is the one received, and it has already arrived."""
        MPI, st = _mpi(), self._status
        if not self.p2p.Iprobe(MPI.ANY_SOURCE, _P2P_TAG, st):
            return None
        source = st.Get_source()
        self.p2p.Recv(buf, source, _P2P_TAG, st)
        return source, st.Get_count(MPI.BYTE)

    def p2p_iallreduce_max(self, send: Array, recv: Array) -> Request:
        return self.p2p.Iallreduce(send, recv, _mpi().MAX)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Free every communicator; only called once nothing is in flight."""
        self._bulk_view.close()
        self._node_data = None
        if self.device_group is not None:
            self.device_group.abort()
        for comm in (self.hdr, self.rows, self.data, self.p2p, self.bulk):
            if comm != _mpi().COMM_NULL:
                comm.Free()


class MPIBackend:
    """MPI world via mpi4py; works under mpiexec, mpirun, srun and singleton."""

    name = "mpi"

    def __init__(self, comm: Any = None) -> None:
        MPI = _mpi()
        self.world = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.world.Set_name("asynclock.world")
        self.rank = self.world.Get_rank()
        self.size = self.world.Get_size()
        self._node = self.world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self._node.Get_rank()
        self.local_size = self._node.Get_size()
        self._cross = self.world.Split(self.local_rank, self.rank)
        self.cross_rank = self._cross.Get_rank()
        self.cross_size = self._cross.Get_size()
        self.thread_level = MPI.Query_thread()
        self._gloo: GlooStore | None = None
        self.bulk_choice = ""  # how bulk allreduces travel, decided at the first channel
        self._device: PGStore | None = None
        self.device_path: DevicePath | None = None  # how CUDA tensors travel (first channel)
        self._channels: list[MPIChannel] = []
        # The watchdog's heartbeats travel on their own communicator, so they
        # never match anything else and a busy data channel cannot delay them.
        self.watchdog_comm = self.world.Dup()
        self.watchdog_comm.Set_name("runtime.watchdog")
        self.heartbeats = MPIHeartbeats(self.watchdog_comm)

    def channel(self, name: str) -> MPIChannel:
        """Collective call: every rank must create channels in the same order."""
        if not self.bulk_choice:
            spans = self.local_size < self.size
            self._gloo, self.bulk_choice = GlooStore.connect(self.world, spans)
            self.device_path, self._device = choose_device_path(
                self.world, self.local_size, spans, settings.text("ASYNCLOCK_CUDA_PATH"))
        ch = MPIChannel(self.world, name, self._gloo, self._device, self._device_backend(),
                        self.local_size == self.size)
        self._channels.append(ch)
        return ch

    def subchannels(self, names: tuple[str, ...], ranks: tuple[int, ...]
                    ) -> list[MPIChannel] | None:
        """A process set's channels (`api.process_sets`), one per name: collective
        over the world, in the same order everywhere; None on ranks outside the set."""
        MPI = _mpi()
        member = self.rank in ranks
        sub = self.world.Split(0 if member else MPI.UNDEFINED, self.rank)
        if not member:
            return None
        try:
            channels = [MPIChannel(sub, name, None, self._device, self._device_backend(),
                                   self.local_size == self.size) for name in names]
        finally:
            sub.Free()
        self._channels.extend(channels)
        return channels

    def _device_backend(self) -> str | None:
        return self.device_path.backend if self.device_path is not None else None

    def close_channel(self, channel: Any) -> None:
        """Free one channel's communicators (its members, once nothing is in flight)."""
        close_channel_of(self._channels, channel)

    def gloo_calls(self) -> int:
        """Bulk allreduces that went through gloo so far (all channels)."""
        return sum(ch.bulk_view().gloo_calls() for ch in self._channels)

    def window_calls(self) -> int:
        """Bulk allreduces that went through a node window so far (all channels)."""
        return sum(ch.bulk_view().window_calls() for ch in self._channels)

    def window_loop_calls(self) -> int:
        """Of those, the allreduces the loop ran step by step (`NodeWindow.on_loop`)."""
        return sum(ch.bulk_view().window_loop_calls() for ch in self._channels)

    def window_c_calls(self) -> int:
        """Of those, the allreduces whose steps ran in C (`NodeWindow.use_c_steps`)."""
        return sum(ch.bulk_view().window_c_calls() for ch in self._channels)

    def describe(self) -> str:
        version = _mpi().Get_library_version().splitlines()[0].strip()
        return f"mpi ({version}, pid {os.getpid()})"

    def shutdown(self, lost: bool = False) -> None:
        """Free every communicator we duplicated; MPI itself stays up for the user."""
        for ch in self._channels:
            ch.close()
        self._channels.clear()
        for store in (self._gloo, self._device):  # their groups are aborted: stop serving
            if store is not None:
                store.close()
        self._gloo = self._device = None
        for comm in (self.watchdog_comm, self._cross, self._node, self.world):
            comm.Free()


# Window allreduces a waiting caller's poller may run on the loop (`NodeWindow.on_loop`):
# each of its steps blocks the loop for one copy or fold of the size, so larger ones
# stay in the wait thread (figures: the benchmarks page).
WINDOW_LOOP_HI = 8 << 20


# On one node MPICH's non-blocking allreduce, tested without pause by the poller of a
# caller that awaits it, moves 1 MiB faster than the wait thread's blocking call with
# its two hand-overs between threads: allreduces below `MPICH_LOOP_HI` stay with it
# there, unless the node window takes them (from ASYNCLOCK_WINDOW_MIN_BYTES on), whose
# steps on the loop, in C, are faster still (figures: the benchmarks page). Their data
# stage starts once the header round has seen every rank, so no rank's poller has
# fallen back to sleeping between tests while the data moves (its tight phase,
# `ProgressPolicy.busy_s`, outlasts such a transfer on one node).
MPICH_LOOP_HI = 2 << 20


def mpich_loop_hi() -> int:
    """Where MPICH's loop band ends on one node: `MPICH_LOOP_HI`, or the node window's
    smallest allreduce where the window is on (agreed settings only)."""
    if settings.flag("ASYNCLOCK_NODE_WINDOW"):
        return min(MPICH_LOOP_HI, int(settings.number("ASYNCLOCK_WINDOW_MIN_BYTES")))
    return MPICH_LOOP_HI


def _loop_band(one_node: bool) -> tuple[int, int]:
    """The sizes of allreduce a waiting caller's poller runs on the loop, however
    large (`Channel.loop_band`): under MPICH on one node, below `mpich_loop_hi()`,
    unless ASYNCLOCK_THREAD_MIN_BYTES is set or ASYNCLOCK_BULK asks for gloo."""
    if one_node and not settings.is_set("ASYNCLOCK_THREAD_MIN_BYTES") and gloo_mode() in (
            "auto", "mpi") and "MPICH" in _mpi().Get_library_version():
        return (0, mpich_loop_hi())
    return (0, 0)


class BulkChannel:
    """Collectives on the channel's `bulk` communicator, run and waited for in the
    engine's wait thread (see `Deferred` for why bulk data goes there, and
    `_run` for how the thread waits for a late peer without spinning;
    `node_window` for why large allreduces go through the node's shared memory
    where a node holds several ranks; and `gloo_bulk` for why allreduces across
    hosts may go through gloo)."""

    def __init__(self, chan: MPIChannel, gloo: GlooGroup | None) -> None:
        self.name, self.rank, self.size = chan.name, chan.rank, chan.size
        self._c = chan.bulk
        self.gloo = gloo
        # ASYNCLOCK_BULK=gloo asks for every large allreduce over gloo, so the
        # window (whose step across nodes is MPI) stands aside.
        windowed = settings.flag("ASYNCLOCK_NODE_WINDOW") and gloo_mode() != "gloo"
        self.window = NodeWindow(self._c, int(settings.number("ASYNCLOCK_WINDOW_MIN_BYTES")),
                                 _mpi_op) if windowed else None

    def gloo_calls(self) -> int:
        return self.gloo.calls if self.gloo is not None else 0

    def window_calls(self) -> int:
        return self.window.calls if self.window is not None else 0

    def window_loop_calls(self) -> int:
        return self.window.loop_calls if self.window is not None else 0

    def window_c_calls(self) -> int:
        return self.window.c_calls if self.window is not None else 0

    def iallreduce(self, send: Array | None, recv: Array, op: ReduceOp) -> Request:
        window = self.window
        if window is not None and window.takes(recv):
            window.handed += 1
            return Deferred(lambda: self._through_window(window, send, recv, op))
        return Deferred(lambda: self._allreduce(send, recv, op))

    def iallreduce_polled(self, send: Array | None, recv: Array, op: ReduceOp) -> Request:
        """`iallreduce` for a caller that awaits it with a core to poll: below
        `WINDOW_LOOP_HI` on one node, a window allreduce the loop runs step by step
        (`NodeWindow.on_loop`), which skips the hand-overs to the wait thread and
        back; otherwise, or until the window is made, the wait thread's."""
        polled = self.loop_allreduce(send, recv, op)
        return polled if polled is not None else self.iallreduce(send, recv, op)

    def loop_ready(self, recv: Array) -> bool:
        """Whether `loop_allreduce` takes an allreduce into `recv` now (this rank's
        state alone: callers that decided to ask still agree on what they issue)."""
        window = self.window
        return (window is not None and recv.nbytes < WINDOW_LOOP_HI and window.takes(recv)
                and window.loop_ready(recv.nbytes))

    def loop_allreduce(self, send: Array | None, recv: Array, op: ReduceOp) -> Request | None:
        """The window allreduce the loop runs step by step, or None where `loop_ready`
        does not hold; nothing is issued then."""
        window = self.window
        if window is None or recv.nbytes >= WINDOW_LOOP_HI or not window.takes(recv):
            return None
        return window.on_loop(send, recv, op)

    def _through_window(self, window: NodeWindow, send: Array | None, recv: Array,
                        op: ReduceOp) -> None:
        try:
            through = window.allreduce(send, recv, op)
        finally:
            window.ended += 1
        if not through:  # no node here holds several ranks
            self._allreduce(send, recv, op)

    def _allreduce(self, send: Array | None, recv: Array, op: ReduceOp) -> None:
        """Over gloo where it measured faster across hosts, else MPI (wait thread)."""
        gloo = self.gloo
        if gloo is not None and gloo.handles(recv, op):
            gloo.allreduce(recv, op, send)
        else:
            into = _in_place(send, recv)
            self._run(lambda: self._c.Allreduce(into, recv, _mpi_op(op)))

    def _run(self, blocking: Callable[[], object]) -> None:
        """One collective, in the wait thread: MPI's blocking call, once an Ibarrier
        (waited for by `settle`, no spinning) shows every rank has reached it. A late
        peer is waited for asleep; the blocking call then waits only while its data
        moves: over shared memory its own copies, across hosts the wire (where MPI
        polls its progress engine for as long as the wire is busy). Its non-blocking
        twin, tested with sleeps, moves data only at each test: 2.4x (Open MPI) to
        5.7x (MPICH) slower for 4 MiB across TCP hosts (figures: the benchmarks page),
        and Open MPI's is 2.6x slower on one node too."""
        settle(self._c.Ibarrier())
        blocking()

    def close(self) -> None:
        if self.window is not None:
            self.window.close()
        if self.gloo is not None:  # its connections end with the channel
            self.gloo.group.abort()

    half_codes = HALF_CODES  # summed 16-bit on the wire, by `iallreduce_half`

    def iallreduce_half(self, data: Array, code: int) -> Request:
        """Sum 16-bit floats in place, 16-bit on the wire (see `ring`)."""
        return Deferred(lambda: self._run(lambda: ring_allreduce_half(self._c, data, code)))

    def ibcast(self, buf: Array, root: int) -> Request:
        return Deferred(lambda: self._run(lambda: self._c.Bcast(_bytes(buf), root)))

    def iallgatherv(self, send: Array, recv: Array, counts: list[int]) -> Request:
        counts = _scaled(counts, recv)
        spec = [_bytes(recv), (counts, _displs(counts))]
        return Deferred(lambda: self._run(lambda: self._c.Allgatherv(_bytes(send), spec)))

    def ireduce_scatter(self, send: Array, recv: Array, counts: list[int],
                        op: ReduceOp) -> Request:
        return Deferred(lambda: self._run(
            lambda: self._c.Reduce_scatter(send, recv, counts, _mpi_op(op))))

    def ialltoall(self, send: Array, recv: Array) -> Request:
        return Deferred(lambda: self._run(lambda: self._c.Alltoall(send, recv)))

    def ialltoallv(self, send: Array, scounts: list[int], recv: Array,
                   rcounts: list[int]) -> Request:
        scounts, rcounts = _scaled(scounts, send), _scaled(rcounts, recv)
        out = [_bytes(send), (scounts, _displs(scounts))]
        into = [_bytes(recv), (rcounts, _displs(rcounts))]
        return Deferred(lambda: self._run(lambda: self._c.Alltoallv(out, into)))
