"""The Horovod transport: headers over MPI, data stages over Horovod's handles.

Horovod and mpi4py share one MPI world (`hvd.init(comm=...)`). The header
round of every checked collective, barriers, the split-count exchange of
alltoall and the sync primitives' point-to-point traffic go over the MPI
communicators of an `MPIChannel` (microseconds), so small collectives whose
payload rides inline in the header (<= 128 B) complete without touching
Horovod at all and are not bound by its cycle time (1 ms by default). Only
data stages go to Horovod: `allreduce_async_`, `broadcast_async_`,
`allgather_async`, `reducescatter_async`, `alltoall_async`.

Names. Horovod's coordinator negotiates every tensor by name, and answers a
name it has seen from its response cache (one bit-vector allreduce per cycle
instead of a round of requests and responses through rank 0) as long as the
name comes back with the same shape and dtype. So a data stage's name is the
same step after step for the same logical tensor, the same on every rank, and
never held twice at once on a rank (Horovod refuses a name in flight):

- a gradient bucket's stage is named after what the bucket holds
  (`asynclock<k>.<lane>.grad.b<bucket>.<layout digest>.grouped...`): every rank
  issues it under that name every round (`named_stages`), on either side of the
  re-plan after the first round wherever the re-plan kept the bucket;
- any other stage after what every rank knows of it, its signature (kind,
  op, dtype, agreed size), and a slot: the slot whose last use lies at least
  `_REUSE_AFTER` stages back on the channel, else a new one. Data stages are
  issued in header order, so every rank counts the same stages and picks the
  same slot; a stage the user names goes the same way, since a call may reach
  the transport by more than one path;
- what the name leaves out must not change under it: a cache hit reuses the
  cached response, whose kind, reduce op and scale factors Horovod does not
  compare, so those are part of every name;
- broadcasts and reduce-scatters, which Horovod never caches, keep a unique
  name (`asynclock<k>.<lane>.<kind>.<n>`) and never wait;
- a stage whose name an earlier stage of this rank still holds is enqueued
  once that one finished (`HorovodRequest`): it is the same name on every
  rank, so this only delays it.

Under `horovodrun --gloo` there is no MPI world. Header rounds, barriers,
agreement rounds and point-to-point messages then travel on a TCP mesh
(`mailbox`), so they still cost microseconds rather than a Horovod cycle
each, and small collectives still never touch Horovod. Only the job's ranks
join it: rank 0 draws a job secret and broadcasts it over Horovod, the
channel the job already trusts with its data, before any mesh socket opens;
every mesh connection proves it (`handshake`). The mesh listens on loopback
when every rank is on one host, else on the address of the interface
horovodrun gave Horovod's gloo (HOROVOD_GLOO_IFACE), and the addresses go
round as numbers, so nothing is unpickled on the way.

Horovod's knobs (HOROVOD_CYCLE_TIME, HOROVOD_FUSION_THRESHOLD,
HOROVOD_TIMELINE, HOROVOD_CACHE_CAPACITY, ...) are read by Horovod from the
environment; asynclock sets two defaults, and only when it initializes Horovod
itself (`HOROVOD_DEFAULTS`; the user's own setting wins):

- HOROVOD_DISABLE_GROUP_FUSION=1. Gradient buckets go as Horovod groups
  (`torch.grouped`); fused with other groups, a bucket's place in Horovod's
  fusion buffer, and with it the order in which 3+ ranks sum each element,
  would depend on which buckets happened to be ready in the same cycle, so the
  same gradients could round differently run to run (and gated and plain
  updates would not be bit-identical under `horovodrun --gloo` at 3 ranks).
  Turning group fusion off costs no measurable throughput (benchmarks page).
- HOROVOD_CYCLE_TIME=5 (ms). Horovod's background thread runs a coordination
  round every cycle, busy or idle: allreduces of its cache bits, whose messages
  keep gloo's receive thread waking as well. On ranks whose cores also train,
  that CPU comes out of backward. Here no header, barrier or small collective
  waits for a cycle (they travel over MPI or the TCP mesh), and gradient buckets
  are already the size Horovod's fusion would make of a cycle's tensors, so a
  longer cycle only delays each data stage's start by up to one cycle, while
  the coordination's CPU falls with the number of cycles (benchmarks page,
  issue 39).
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..base.backoff import Backoff, poll_until
from ..base.errors import BackendError
from ..base.ops import DTYPE_CODES, ReduceOp
from .base import DONE, Array, Request, close_channel_of
from .handshake import SECRET_BYTES, MeshKey
from .heartbeat import MailboxHeartbeats, MPIHeartbeats
from .horovod_elastic import GlooSockets
from .horovod_mpi import check_launcher, check_mpi4py, horovod_mpi
from .mailbox import AGREE, DATA, Address, Mailbox, MailboxPort
from .mpi import MPIBackend, MPIChannel
from .node_segment import NodeSegment

Finish = Callable[[Any], None]
Launch = Callable[[Any, str], int]  # (horovod.torch, op name) -> handle
Enqueue = Callable[[], int]  # a launch with its name bound

# dtypes Horovod's CPU allreduce/reducescatter accept; smaller ints go as int64.
_NATIVE = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int32, np.int64))
_MIN_PAUSE, _MAX_PAUSE = 20e-6, 1e-3
_PAUSE_SHARE = 0.1  # a wait sleeps at most this share of its time so far between polls
# What asynclock sets when it initializes Horovod, unless set: see the module docstring.
HOROVOD_DEFAULTS = {"HOROVOD_DISABLE_GROUP_FUSION": "1", "HOROVOD_CYCLE_TIME": "5"}
# An unnamed stage takes the first of its signature's names last used at least this many
# stages back on the channel: enough names for a burst of equal stages in flight at once,
# few enough that a step's stages come back to the same names.
_REUSE_AFTER = 64
_FORGET_AFTER = 4096  # a signature unused for this many stages gives up its names
_UNCACHED = frozenset({"broadcast", "reducescatter"})  # kinds Horovod never caches
_instances = itertools.count()  # backends are made in the same order on every rank
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_module: Any = None


def _hvd() -> Any:
    """Import Horovod lazily (`import asynclock` must work without it), once:
    `Test` calls this on every poll."""
    global _module
    if _module is None:
        import horovod.torch as hvd

        _module = hvd
    return _module


def _tensor(arr: Array) -> Any:
    """A torch tensor sharing `arr`'s memory (read-only buffers are copied:
    torch only wraps writable ones)."""
    import torch

    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def _raw(arr: Array) -> Array:
    """Moved-only data travels as bytes: every dtype, bfloat16 included."""
    return arr.reshape(-1).view(np.uint8)


def _hvd_op(op: ReduceOp) -> Any:
    """AVERAGE sums here; the collective divides afterwards, as it does on MPI."""
    hvd = _hvd()
    return {ReduceOp.SUM: hvd.Sum, ReduceOp.AVERAGE: hvd.Sum, ReduceOp.MIN: hvd.Min,
            ReduceOp.MAX: hvd.Max, ReduceOp.PRODUCT: hvd.Product}[op]


def _reducible(arr: Array, copy: bool) -> Array:
    """`arr` in a dtype Horovod reduces; int8/uint8/int16 widen to int64 (the
    narrowing copy back wraps exactly as MPI's narrow arithmetic would)."""
    if arr.dtype in _NATIVE:
        return arr.copy() if copy else arr
    return arr.astype(np.int64)


def _copy_into(dst: Array, out: Any) -> None:
    """Copy a Horovod-allocated result into the caller's buffer, checking its size."""
    src = out.numpy().reshape(-1)
    if src.size != dst.size:
        raise BackendError(f"horovod returned {src.size} elements where {dst.size} were agreed")
    np.copyto(dst.reshape(-1), src, casting="unsafe")


def _split(rows: int, size: int) -> list[int]:
    """Horovod's reducescatter split of dim 0: first ranks get the extra row."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _row_width(counts: list[int], size: int) -> int | None:
    """Elements per row if `counts` is Horovod's own split of some 2-D tensor."""
    width = math.gcd(*counts)
    if width == 0:
        return None
    rows = [c // width for c in counts]
    return width if rows == _split(sum(rows), size) else None


class HorovodRequest:
    """A Horovod handle with mpi4py's `Test`/`Wait`; `finish` copies results out.

    Made with `after`, the request that last held its name on this rank: until that
    one finished, Horovod would refuse the name, so it is enqueued by the first
    `Test` or `Wait` that finds its name free.

    A failed operation raises `BackendError` from `Test`/`Wait`; the engine
    fails that operation only, on every rank (Horovod reports a failure to
    every rank taking part).
    """

    __slots__ = ("handle", "what", "finish", "done", "_enqueue", "_after")

    def __init__(self, what: str, enqueue: Enqueue, finish: Finish | None,
                 after: HorovodRequest | None = None) -> None:
        self.what, self.finish = what, finish
        self.done = False
        self.handle: int | None = None
        self._enqueue: Enqueue | None = enqueue
        self._after = after
        if after is None or after.released():
            self._start()

    def _start(self) -> None:
        enqueue, self._enqueue, self._after = self._enqueue, None, None
        assert enqueue is not None
        try:
            self.handle = enqueue()
        except Exception as exc:  # refused at enqueue: e.g. Horovod is shut down
            self.done = True  # holds its name no longer
            raise BackendError(f"horovod {self.what}: {exc}") from exc

    def _started(self) -> bool:
        """Enqueued in Horovod, now if its name just became free."""
        if self.handle is None:
            after = self._after
            if after is not None and not after.released():
                return False
            self._start()
        return True

    def released(self) -> bool:
        """Horovod no longer holds this request's name: it finished or failed."""
        if self.done:
            return True
        if self.handle is None:
            return False
        try:
            return bool(_hvd().poll(self.handle))
        except Exception:  # another thread's `synchronize` cleared the handle: finished
            return True

    def Test(self) -> bool:  # noqa: N802 - mpi4py's spelling
        if self.done:
            return True
        if not self._started() or not _hvd().poll(self.handle):
            os.sched_yield()  # only Horovod's thread can finish it: let it have the core
            return False
        self._complete()
        return True

    def Wait(self) -> None:  # noqa: N802
        """Sleep-poll in the wait thread: `hvd.synchronize` spins a core on
        `yield()`, which a 2-core host shares with Horovod's own thread."""
        if self.handle is None:
            poll_until(self._started, Backoff(_MIN_PAUSE, _MAX_PAUSE, share=_PAUSE_SHARE))
        poll, handle = _hvd().poll, self.handle
        poll_until(lambda: self.done or bool(poll(handle)),
                   Backoff(_MIN_PAUSE, _MAX_PAUSE, share=_PAUSE_SHARE))
        if not self.done:
            self._complete()

    def _complete(self) -> None:
        self.done = True
        try:
            out = _hvd().synchronize(self.handle)
        except Exception as exc:  # HorovodInternalError and friends
            raise BackendError(f"horovod {self.what}: {exc}") from exc
        if self.finish is not None:
            self.finish(out)


def _crc(values: Any) -> str:
    """A short digest of agreed numbers (the same on every rank, unlike `hash`)."""
    return f"{zlib.crc32(','.join(map(str, values)).encode()):08x}"


class HorovodChannel:
    """One subsystem's traffic: MPI (or the gloo fallbacks) for headers, Horovod for data."""

    def __init__(self, name: str, prefix: str, rank: int, size: int,
                 mpi: MPIChannel | None, port: MailboxPort | None) -> None:
        self.name, self.rank, self.size = name, rank, size
        self.mpi, self.port = mpi, port
        self._prefix = f"{prefix}.{name}"
        self._issued = 0  # data stages started here: the same count on every rank
        self._label = ""  # the name of the stages being started (`named_stages`)
        self._slots: dict[str, list[int]] = {}  # signature -> when each of its names was used
        self._holders: dict[str, HorovodRequest] = {}  # name -> its latest request
        self._sweep_at = 256

    @contextmanager
    def named_stages(self, name: str) -> Iterator[None]:
        """Stages started inside are named after `name` (a gradient bucket), which every
        rank gives the same stage, the same each time it comes back."""
        self._label = name
        try:
            yield
        finally:
            self._label = ""

    def _name(self, kind: str, sig: str, key: str) -> tuple[str, bool]:
        """The stage's name (see the module text), and whether an earlier stage may hold it.
        `sig`: what must not change under one name; `key`: the rest of what every rank
        knows of the stage, for stages without a label."""
        n = self._issued
        self._issued = n + 1
        if n and n % _FORGET_AFTER == 0:
            self._slots = {k: uses for k, uses in self._slots.items()
                           if max(uses) > n - _FORGET_AFTER}
        if kind in _UNCACHED:
            return f"{self._prefix}.{kind}.{n}", False
        if self._label:
            return f"{self._prefix}.{self._label}.{kind}{sig}", True
        signature = f"{kind}{sig}{key}"
        uses = self._slots.setdefault(signature, [])
        for slot, last in enumerate(uses):
            if n - last >= _REUSE_AFTER:
                uses[slot] = n
                break
        else:
            slot = len(uses)
            uses.append(n)
        return f"{self._prefix}.{signature}.s{slot}", True

    def _start(self, kind: str, sig: str, key: str, what: str, launch: Launch,
               finish: Finish | None = None) -> HorovodRequest:
        """Name the op and issue it, once no earlier stage of this rank holds the name."""
        name, reused = self._name(kind, sig, key)
        after = self._holders.get(name) if reused else None
        hvd = _hvd()
        req = HorovodRequest(f"{what} {name}", lambda: launch(hvd, name), finish, after)
        if reused:
            self._holders[name] = req
            if len(self._holders) > self._sweep_at:  # forget names no request holds
                self._holders = {k: r for k, r in self._holders.items() if not r.released()}
                self._sweep_at = max(256, 2 * len(self._holders))
        return req

    # -- header rounds: MPI when there is a world, else the TCP mesh -------------
    @property
    def compact(self) -> bool:
        """The compact header round runs on MPI's header communicator only."""
        return self.mpi is not None

    def iallreduce_compact(self, send: Array, recv: Array) -> Request:
        assert self.mpi is not None
        return self.mpi.iallreduce_compact(send, recv)

    def node_segment(self, wanted: bool, rank_bytes: int) -> NodeSegment | None:
        """Collective: the MPI channel's (`MPIChannel.node_segment`), where it has one."""
        return None if self.mpi is None else self.mpi.node_segment(wanted, rank_bytes)

    def iallgather_slots(self, send: Array, recv: Array) -> Request:
        if self.mpi is not None:
            return self.mpi.iallgather_slots(send, recv)
        assert self.port is not None
        return self.port.iallgather(send, recv)

    def ibarrier(self) -> Request:
        """Ordered with the header rounds, as MPI's Ibarrier on the header communicator."""
        if self.mpi is not None:
            return self.mpi.ibarrier()
        assert self.port is not None
        return self.port.iallgather(np.zeros(1, np.int64), np.empty(self.size, np.int64))

    # -- data stages: Horovod ----------------------------------------------------
    def iallreduce(self, send: Array | None, recv: Array, op: ReduceOp) -> Request:
        work = recv if recv.dtype in _NATIVE else np.empty(recv.shape, np.int64)
        if send is not None or work is not recv:
            np.copyto(work, recv if send is None else send, casting="unsafe")
        t = _tensor(work)
        finish = None if work is recv else (lambda _: np.copyto(recv, work, casting="unsafe"))
        return self._start("allreduce", f".{op.name.lower()}", f".{work.dtype}.{work.size}",
                           "allreduce", lambda h, n: h.allreduce_async_(t, name=n, op=_hvd_op(op)),
                           finish)

    def iallreduce_grouped(self, inputs: list[Any], outputs: list[Any],
                           prescale: float) -> Request:
        """Sum `inputs` (torch tensors) into `outputs`, scaled by `prescale` first, as one
        Horovod group: Horovod copies them into its fusion buffer and back out, so a
        gradient bucket travels without asynclock copying it first (`torch.grouped`).
        Every rank passes the same number of tensors, of the same sizes, in one order."""
        def launch(h: Any, name: str) -> int:
            return int(h.mpi_ops._grouped_allreduce_async(
                inputs, outputs, name, h.Sum, prescale, 1.0, h.global_process_set))

        sizes = [int(o.numel()) for o in outputs]
        key = f".{str(outputs[0].dtype).removeprefix('torch.')}.{len(sizes)}.{_crc(sizes)}"
        return self._start("grouped", f".x{prescale!r}", key, "grouped allreduce", launch)

    half_codes = frozenset({DTYPE_CODES["float16"]})  # Horovod sums float16 itself

    def iallreduce_half(self, data: Array, code: int) -> Request:
        """float16 stays float16 on the wire: Horovod's own half allreduce."""
        import torch

        t = _tensor(data.view(np.int16)).view(torch.float16)
        return self._start("allreduce", ".sum", f".float16.{data.size}", "allreduce",
                           lambda h, n: h.allreduce_async_(t, name=n, op=h.Sum))

    def ibcast(self, buf: Array, root: int) -> Request:
        t = _tensor(_raw(buf))
        return self._start("broadcast", "", "", "broadcast",
                           lambda h, n: h.broadcast_async_(t, root, name=n))

    def iallgatherv(self, send: Array, recv: Array, counts: list[int]) -> Request:
        """Horovod gathers dim 0 of any length; `counts` was agreed in the headers."""
        t = _tensor(_raw(send))
        return self._start("allgather", "", f".{send.dtype}.{_crc(counts)}", "allgather",
                           lambda h, n: h.allgather_async(t, name=n),
                           lambda out: _copy_into(_raw(recv), out))

    def ireduce_scatter(self, send: Array, recv: Array, counts: list[int],
                        op: ReduceOp) -> Request:
        """Horovod's reducescatter does SUM (and AVERAGE) on its own row split;
        anything else is an allreduce of which this rank keeps its slice."""
        if sum(counts) == 0:
            return DONE
        width = _row_width(counts, self.size)
        if width is None or op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            return self._reduce_then_slice(send, recv, counts, op)
        t = _tensor(_reducible(send, copy=False).reshape(-1, width))
        return self._start("reducescatter", "", "", "reducescatter",
                           lambda h, n: h.reducescatter_async(t, name=n, op=h.Sum),
                           lambda out: _copy_into(recv, out))

    def _reduce_then_slice(self, send: Array, recv: Array, counts: list[int],
                           op: ReduceOp) -> Request:
        full = _reducible(send.reshape(-1), copy=True)
        start = sum(counts[: self.rank])
        mine, out = full[start: start + counts[self.rank]], recv.reshape(-1)
        t = _tensor(full)
        return self._start("allreduce", f".{op.name.lower()}", f".{full.dtype}.{full.size}",
                           "allreduce(reduce_scatter)",
                           lambda h, n: h.allreduce_async_(t, name=n, op=_hvd_op(op)),
                           lambda _: np.copyto(out, mine, casting="unsafe"))

    def ialltoall(self, send: Array, recv: Array) -> Request:
        """Equal blocks (the split counts of `alltoall`): MPI, or the TCP mesh as an
        allgather of which each rank keeps its column (these are a few words)."""
        if self.mpi is not None:
            return self.mpi.ialltoall(send, recv)
        assert self.port is not None
        rows = np.empty((self.size, send.size), send.dtype)
        mine = rows.reshape(self.size, self.size, -1)[:, self.rank]
        return self.port.iallgather(send, rows, DATA, lambda: np.copyto(
            recv.reshape(self.size, -1), mine))

    def ialltoallv(self, send: Array, scounts: list[int], recv: Array,
                   rcounts: list[int]) -> Request:
        t, splits = _tensor(_raw(send)), [c * send.itemsize for c in scounts]
        return self._start("alltoall", "", f".{send.dtype}", "alltoall",
                           lambda h, n: h.alltoall_async(t, splits=splits, name=n),
                           lambda out: _copy_into(_raw(recv), out[0]))

    loop_band = (0, 0)  # Horovod's own thread moves its data stages

    def bulk_view(self) -> None:
        """None: Horovod's background thread moves bulk data; the engine's
        wait thread only sleep-polls its handle (`HorovodRequest.Wait`)."""
        return None

    # -- point-to-point (sync primitives) ------------------------------------------
    def p2p_isend(self, buf: Array, dest: int) -> Request:
        if self.mpi is not None:
            return self.mpi.p2p_isend(buf, dest)
        assert self.port is not None
        return self.port.isend(buf, dest)

    def p2p_try_recv(self, buf: Array) -> tuple[int, int] | None:
        if self.mpi is not None:
            return self.mpi.p2p_try_recv(buf)
        assert self.port is not None
        return self.port.try_recv(buf)

    def p2p_iallreduce_max(self, send: Array, recv: Array) -> Request:
        if self.mpi is not None:
            return self.mpi.p2p_iallreduce_max(send, recv)
        assert self.port is not None
        rows = np.empty((self.size, *send.shape), send.dtype)
        return self.port.iallgather(send, rows, AGREE, lambda: np.max(rows, axis=0, out=recv))

    def close(self) -> None:
        if self.mpi is not None:
            self.mpi.close()


def _controller(hvd: Any, comm: Any) -> str:
    """`mpi` when Horovod and mpi4py can share an MPI world, else `gloo`."""
    if comm is not None:
        return "mpi"
    if hvd.is_initialized():
        return "mpi" if hvd.mpi_enabled() else "gloo"
    if os.environ.get("HOROVOD_CONTROLLER", "").lower() == "gloo" or not hvd.mpi_built():
        return "gloo"
    try:
        from mpi4py import MPI  # noqa: F401
    except Exception:
        return "gloo"
    return "mpi"


def _job_secret(hvd: Any, rank: int, name: str) -> bytes:
    """Random bytes drawn by rank 0 and broadcast over Horovod's own collectives.

    horovodrun keeps its own key (`_HOROVOD_SECRET_KEY`) from the ranks, and an
    environment variable would show on the command line horovodrun starts remote
    ranks with; the broadcast is the channel the job already trusts with its data.
    """
    import torch

    mine = bytearray(os.urandom(SECRET_BYTES) if rank == 0 else bytes(SECRET_BYTES))
    got = hvd.broadcast(torch.frombuffer(mine, dtype=torch.uint8), root_rank=0, name=name)
    return bytes(got.numpy().tobytes())


def _rank0s(hvd: Any, value: int) -> int:
    """Rank 0's `value` on every rank, over Horovod: what names a backend's Horovod
    operations must agree, and a rank that joined an elastic job later has made
    fewer backends than the ranks that were there before it."""
    import torch

    got = hvd.broadcast(torch.tensor([value], dtype=torch.int64), root_rank=0,
                        name="asynclock.backend")
    return int(got.item())


def _listen_host(one_host: bool) -> str:
    """The IPv4 address the meshes listen on and tell their peers: loopback when the
    job has one host, else the interface horovodrun gave Horovod's gloo, else what
    this host's name resolves to."""
    if one_host:
        return "127.0.0.1"
    iface = os.environ.get("HOROVOD_GLOO_IFACE")
    if iface:
        return _interface_address(iface)
    return socket.gethostbyname(os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname())


def _interface_address(iface: str) -> str:
    import fcntl

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR,
                                 struct.pack("256s", iface.encode()[:15]))
    except OSError as exc:
        raise BackendError(f"HOROVOD_GLOO_IFACE={iface}: no IPv4 address ({exc})") from exc
    return socket.inet_ntoa(packed[20:24])


def _allgather_addresses(hvd: Any, address: Address, name: str) -> list[Address]:
    """Every rank's (IPv4 address, port) in rank order, as numbers over Horovod."""
    import torch

    ip = int.from_bytes(socket.inet_aton(address[0]), "big")
    rows = hvd.allgather(torch.tensor([[ip, address[1]]], dtype=torch.int64), name=name)
    return [(socket.inet_ntoa(int(ip).to_bytes(4, "big")), int(port))
            for ip, port in rows.tolist()]


class HorovodBackend:
    """Horovod (MPI or gloo controller) with asynclock's checked headers in front."""

    name = "horovod"

    def __init__(self, comm: Any = None) -> None:
        hvd = _hvd()
        self.controller = _controller(hvd, comm)
        self._owns_horovod = not hvd.is_initialized()
        if self.controller == "mpi" and self._owns_horovod:  # before any MPI_Init
            built = horovod_mpi(Path(hvd.__file__).resolve().parents[1])
            check_launcher(built, os.environ)
        self._mpi = MPIBackend(comm) if self.controller == "mpi" else None
        if self._mpi is not None and self._owns_horovod:
            from mpi4py import MPI

            check_mpi4py(built, MPI.Get_library_version())
        self._gloo: GlooSockets | None = None
        if self._owns_horovod:
            self._init_horovod(hvd)
        self._check_ranks(hvd)
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.cross_rank, self.cross_size = hvd.cross_rank(), hvd.cross_size()
        instance = next(_instances)
        if self._mpi is None:  # elastic: a rank that joins later counts from 0
            instance = _rank0s(hvd, instance)
        self._prefix = f"asynclock{instance}"
        self._mailbox: Mailbox | None = None
        self.heartbeats: MPIHeartbeats | MailboxHeartbeats
        if self._mpi is not None:
            self.heartbeats = self._mpi.heartbeats
        else:
            secret = _job_secret(hvd, self.rank, f"{self._prefix}.secret")
            host = _listen_host(self.local_size == self.size)
            self._mailbox = self._mesh(hvd, secret, host, "mailbox")
            self.heartbeats = MailboxHeartbeats(  # the watchdog thread's own
                self._mesh(hvd, secret, host, "heartbeat"))
        self._channels: list[HorovodChannel] = []
        self._ports = itertools.count()  # mailbox channel ids: never reused after a close

    @property
    def thread_level(self) -> int | None:
        """MPI's thread level where Horovod runs its MPI controller (None under Gloo)."""
        return None if self._mpi is None else self._mpi.thread_level

    def _mesh(self, hvd: Any, secret: bytes, host: str, what: str) -> Mailbox:
        """A TCP mesh between the ranks (no MPI world) that only holders of `secret` join;
        addresses go round over Horovod."""
        name = f"{self._prefix}.{what}"
        return Mailbox(self.rank, self.size, MeshKey(secret, name), host,
                       lambda address: _allgather_addresses(hvd, address, name))

    def refused_connections(self) -> int:
        """Connections the TCP meshes refused while they were built (0 under MPI)."""
        boxes = [self._mailbox]
        if isinstance(self.heartbeats, MailboxHeartbeats):
            boxes.append(self.heartbeats.box)
        return sum(box.refused for box in boxes if box is not None)

    def _init_horovod(self, hvd: Any) -> None:
        """Horovod's background thread calls MPI while our loop does: THREAD_MULTIPLE."""
        mpi = self._mpi
        if mpi is not None:
            from mpi4py import MPI

            if mpi.thread_level < MPI.THREAD_MULTIPLE:
                raise BackendError("the Horovod backend needs MPI_THREAD_MULTIPLE (mpi4py's "
                                   f"default); MPI was initialized with level {mpi.thread_level}")
        for key, value in HOROVOD_DEFAULTS.items():
            os.environ.setdefault(key, value)  # the user's own setting wins
        before = GlooSockets.snapshot() if mpi is None else {}
        try:
            hvd.init(comm=mpi.world) if mpi is not None else hvd.init()
        except Exception as exc:
            raise BackendError(f"hvd.init() failed ({self.controller} controller): {exc}") from exc
        if mpi is None:
            self._gloo = GlooSockets(before)

    def _check_ranks(self, hvd: Any) -> None:
        """A Horovod the user initialized on another communicator would mis-route data."""
        mpi = self._mpi
        if mpi is not None and (hvd.rank(), hvd.size()) != (mpi.rank, mpi.size):
            raise BackendError(
                f"Horovod rank {hvd.rank()} of {hvd.size()} is MPI rank {mpi.rank} of {mpi.size}: "
                "initialize Horovod on the communicator given to asynclock (hvd.init(comm=...))")

    def channel(self, name: str) -> HorovodChannel:
        """Collective call: every rank must create channels in the same order."""
        mpi = self._mpi.channel(name) if self._mpi is not None else None
        port = self._mailbox.port(next(self._ports)) if self._mailbox is not None else None
        ch = HorovodChannel(name, self._prefix, self.rank, self.size, mpi, port)
        self._channels.append(ch)
        return ch

    def close_channel(self, channel: Any) -> None:
        close_channel_of(self._channels, channel)

    def describe(self) -> str:
        import horovod

        if self._mpi is not None:
            from mpi4py import MPI

            headers = MPI.Get_library_version().split(",")[0].strip()
        else:
            headers = "a TCP mesh"
        return (f"horovod {horovod.__version__} ({self.controller} controller; headers over "
                f"{headers}; pid {os.getpid()})")

    def shutdown(self, lost: bool = False) -> None:
        """Stop Horovod if we started it, then free our communicators. When the world is
        `lost`, gloo's connections end first: Horovod's shutdown waits for its background
        loop, which may wait in a receive from a peer behind a cut link, where no reset
        ever comes, until gloo's timeout (30 s)."""
        if lost and self._gloo is not None:
            self._gloo.end_connections()
        for ch in self._channels:
            ch.close()
        self._channels.clear()
        if self._mailbox is not None:
            self._mailbox.close()
        if isinstance(self.heartbeats, MailboxHeartbeats):
            self.heartbeats.close()  # the watchdog said `closing` before this
        if self._owns_horovod:
            _hvd().shutdown()
        if self._gloo is not None:  # peers stuck in a receive from us go on now
            self._gloo.end_connections()
        if self._mpi is not None:
            self._mpi.shutdown()
