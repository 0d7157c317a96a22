"""asynclock's own torch.distributed process groups: one component for gloo and NCCL.

Two paths move data through torch's collectives instead of MPI: bulk
allreduces across hosts over gloo (`gloo_bulk`), and CUDA tensors over NCCL
(`engine.device_pg`). Both need the same things, and get them here:

- **set-up**: a TCP store that rank 0 serves on the one address the others
  are given (loopback within a node), reached by every rank; made
  collectively over MPI and agreed: if any rank cannot, no rank uses it;
- **trust**: the store is bound as narrowly as the job allows (network trust
  rules: docs/guide/security.md) and lives as long as the backend: its shutdown
  (an elastic reset too) closes it, and rank 0 stops listening;
- **groups**: one per channel and backend, under a prefix of the store, so
  a program's own `init_process_group` and default group are never touched;
  connected lazily on the first call, which every rank makes in the order
  the header round agreed;
- **per call**: `issue_*` starts the collective and returns torch's `Work`;
  a `PGRequest` lets the engine poll it (`Work.is_completed()`, which for
  NCCL queries the collective's end event: never a host synchronize);
- **teardown**: `abort()` ends a group's communicators (an elastic reset),
  instead of leaving them to wait for peers that are gone.

Only the backend name differs between the gloo and the NCCL path; the CPU
twin of the NCCL path (`ASYNCLOCK_CUDA_PATH=gloo-twin`, CI) runs this very
code with gloo and CPU tensors.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..base.ops import ReduceOp

SETUP_TIMEOUT = timedelta(seconds=60)
OP_TIMEOUT = timedelta(seconds=600)  # a dead peer resets the connection long before
BACKENDS = ("gloo", "nccl")


def torch_distributed() -> Any:
    """torch.distributed if the program already imported torch (asynclock alone never
    pays for importing it), else None."""
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() else None


def backend_usable(backend: str) -> bool:
    """torch here has `backend` built in (NCCL also needs a GPU this rank can use)."""
    dist = torch_distributed()
    if dist is None:
        return False
    if backend == "gloo":
        return bool(dist.is_gloo_available())
    import torch

    return bool(dist.is_nccl_available() and torch.cuda.is_available())


def agreed(comm: Any, ok: bool) -> bool:
    """True on every rank of `comm` when it is true on every rank (collective)."""
    from mpi4py import MPI

    return bool(comm.allreduce(int(ok), op=MPI.MIN))


def serve(size: int, spans: bool) -> tuple[tuple[str, int], Any] | None:
    """Rank 0: listen on the one address the other ranks are given (loopback within a
    node, the host's address across hosts); the address and the serving store. torch's
    store would listen on every interface, so it gets a socket already bound there."""
    import torch.distributed as dist

    try:
        addr = socket.gethostbyname(socket.gethostname()) if spans else "127.0.0.1"
        listener = socket.create_server((addr, 0), backlog=size + 16)
    except OSError:
        return None
    port = listener.getsockname()[1]
    try:  # the store owns the socket from here on
        store = dist.TCPStore(addr, port, size, True, SETUP_TIMEOUT, wait_for_workers=False,  # type: ignore[attr-defined]
                              master_listen_fd=listener.detach())
    except (OSError, RuntimeError):
        return None
    return (addr, port), store


def reach(comm: Any, where: tuple[str, int] | None) -> Any:
    """A client of rank 0's store at `where`, or None."""
    if where is None:
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(where[0], where[1], comm.Get_size(), False, SETUP_TIMEOUT)  # type: ignore[attr-defined]
    except (OSError, RuntimeError):
        return None


class PGStore:
    """One TCP store per backend (rank 0 serves it); groups per channel under it."""

    def __init__(self, store: Any, rank: int, size: int) -> None:
        self.store, self.rank, self.size = store, rank, size
        self._made = 0

    @staticmethod
    def open(comm: Any, spans: bool) -> tuple[Any, str]:
        """Collective over `comm`: a store every rank reached (or None on all), and why
        not. The caller has agreed that every rank wants one."""
        served = serve(comm.Get_size(), spans) if comm.Get_rank() == 0 else None
        where = comm.bcast(served[0] if served is not None else None, root=0)
        store = served[1] if served is not None else reach(comm, where)
        if not agreed(comm, store is not None):
            return None, "a rank could not reach rank 0's store"
        return store, ""

    def close(self) -> None:
        """Let go of the store (the backend's shutdown, an elastic reset, once its
        groups are aborted): rank 0 stops listening, the others disconnect."""
        self.store = None

    def group(self, name: str, backend: str) -> PGGroup:
        """A channel's group (every rank makes channels in the same order, so the
        prefixes agree); it connects on its first call."""
        self._made += 1
        return PGGroup(self, f"asynclock/{self._made}/{backend}/{name}", backend)

    def channel_group(self, name: str, backend: str, rank: int, size: int) -> PGGroup:
        """The group of channel `name` (unique in the job: a process set's members make
        it and the others do not), numbered within the channel's ranks."""
        return PGGroup(self, f"asynclock/channel/{backend}/{name}", backend, rank, size)


class PGGroup:
    """One channel's process group of one backend, connected on its first call."""

    def __init__(self, store: PGStore, prefix: str, backend: str, rank: int | None = None,
                 size: int | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown process-group backend {backend!r}")
        self.store, self.prefix, self.backend = store, prefix, backend
        self.rank = store.rank if rank is None else rank
        self.size = store.size if size is None else size
        self.pg: Any = None
        self.calls = 0

    def _connected(self) -> Any:
        if self.pg is None:
            import torch.distributed as dist

            prefixed = dist.PrefixStore(self.prefix, self.store.store)  # type: ignore[attr-defined]
            if self.backend == "gloo":
                self.pg = dist.ProcessGroupGloo(prefixed, self.rank, self.size, OP_TIMEOUT)
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = OP_TIMEOUT
                self.pg = dist.ProcessGroupNCCL(prefixed, self.rank, self.size, opts)
        return self.pg

    def connect(self) -> None:
        """Connect now (collective over the group's ranks; blocks until all have)."""
        self._connected()

    def device(self) -> Any:
        """Where this rank's tensors for the group live when it makes its own (a joined
        rank's stand-in): its current GPU for NCCL, the CPU for gloo."""
        import torch

        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def issue_allreduce(self, tensor: Any, op: ReduceOp) -> Any:
        """Start reducing `tensor` in place (AVERAGE sums: the caller scales on its
        stream, as gloo has no average); returns torch's Work."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = _ops(dist)[op]
        self.calls += 1
        return self._connected().allreduce([tensor], opts)

    def issue_broadcast(self, tensor: Any, root: int) -> Any:
        """Start broadcasting `tensor` from `root`, in place; returns torch's Work."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self.calls += 1
        return self._connected().broadcast([tensor], opts)

    def issue_allgather(self, out: Any, tensor: Any) -> Any:
        """Start gathering every rank's `tensor` (one size on every rank) into `out`,
        in rank order; returns torch's Work."""
        self.calls += 1
        return self._connected()._allgather_base(out, tensor)

    def issue_alltoall(self, out: Any, tensor: Any, out_splits: list[int],
                       in_splits: list[int]) -> Any:
        """Start sending `in_splits[r]` elements of `tensor` to rank r and receiving
        `out_splits[r]` from it into `out`, in rank order; returns torch's Work."""
        import torch.distributed as dist

        self.calls += 1
        return self._connected().alltoall_base(out, tensor, out_splits, in_splits,
                                               dist.AllToAllOptions())

    def allreduce(self, tensor: Any, op: ReduceOp) -> None:
        """Reduce in place and wait (a lane's wait thread: gloo sleeps in the kernel)."""
        self.issue_allreduce(tensor, op).wait()

    def abort(self) -> None:
        """End the group's communicators now (an elastic reset); the group is unusable."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        for name in ("abort", "shutdown"):
            end = getattr(pg, name, None)
            if callable(end):
                with contextlib.suppress(RuntimeError):  # already ended by a peer's loss
                    end()
                return


@dataclass(frozen=True)
class DevicePath:
    """How CUDA tensors travel in this job, agreed by every rank, and why."""

    path: str  # "nccl", "gloo-twin" (the NCCL path's code over gloo), "staged" or "direct"
    reason: str

    @property
    def backend(self) -> str | None:
        """The process-group backend of the path, if it has one."""
        return {"nccl": "nccl", "gloo-twin": "gloo"}.get(self.path)


_CHOSEN: list[DevicePath] = []  # the last choice made in this process (`describe`)


def chosen_device_path() -> DevicePath | None:
    return _CHOSEN[-1] if _CHOSEN else None


def choose_device_path(comm: Any, local_size: int, spans: bool, wanted: str
                       ) -> tuple[DevicePath, PGStore | None]:
    """Collective over `comm` (every rank passes the same agreed `wanted`): the path of
    CUDA tensors and, for a process-group path, the store its groups live under.

    `auto` and `nccl` take NCCL where every rank has torch with NCCL and a GPU of
    its own on its node (NCCL refuses two ranks on one GPU); otherwise host
    staging, as `staged` does. `direct` is the CUDA-aware MPI path."""
    if wanted in ("staged", "direct"):
        return _chose(DevicePath(wanted, f"ASYNCLOCK_CUDA_PATH={wanted}")), None
    backend = "gloo" if wanted == "gloo-twin" else "nccl"
    mine, why = _can_use(backend, local_size)
    if not agreed(comm, mine):
        who = "this rank" if not mine else "another rank"
        return _chose(DevicePath("staged", f"{backend} not usable on every rank "
                                           f"({who}: {why or 'see that rank'})")), None
    store, why = PGStore.open(comm, spans)
    if store is None:
        return _chose(DevicePath("staged", why)), None
    reason = ("ASYNCLOCK_CUDA_PATH=gloo-twin" if wanted == "gloo-twin" else
              f"torch has NCCL and every rank a GPU of its own ({wanted})")
    return _chose(DevicePath(wanted if wanted != "auto" else "nccl", reason)), PGStore(
        store, comm.Get_rank(), comm.Get_size())


def _can_use(backend: str, local_size: int) -> tuple[bool, str]:
    if not backend_usable(backend):
        return False, f"torch without {backend}" + (" or without a GPU"
                                                    if backend == "nccl" else "")
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < local_size:
            return False, (f"{local_size} ranks on this node share "
                           f"{torch.cuda.device_count()} GPU(s)")
    return True, ""


def _chose(path: DevicePath) -> DevicePath:
    _CHOSEN.append(path)
    return path


class PGRequest:
    """A started process-group collective, as the engine polls requests: `Test()`
    never blocks (NCCL's completion is its end event, queried), `Wait()` does."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def Test(self) -> bool:  # noqa: N802 - the engine's request protocol (MPI's names)
        if not self.work.is_completed():
            return False
        self.work.wait()  # raises the collective's error, if it failed; else at once
        return True

    def Wait(self) -> None:  # noqa: N802
        self.work.wait()


def _ops(dist: Any) -> dict[ReduceOp, Any]:
    r = dist.ReduceOp
    return {ReduceOp.SUM: r.SUM, ReduceOp.AVERAGE: r.SUM, ReduceOp.MIN: r.MIN,
            ReduceOp.MAX: r.MAX, ReduceOp.PRODUCT: r.PRODUCT}
