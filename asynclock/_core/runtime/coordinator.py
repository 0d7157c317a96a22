"""The per-rank Coordinator: backend choice, lifecycle, rank and size.

`async with asynclock.start() as coord:` runs the progress engine on the
caller's loop (asyncio or trio). `asynclock.init()` is the Horovod-style
synchronous entry: it creates the coordinator now, and synchronous calls
(e.g. from `asynclock.torch`) run the engine on a private loop thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

from ..api.agreement import agree_config
from ..api.collectives import Collectives, LaneCollectives
from ..api.process_sets import Subset, make_subset, remove_subset
from ..base import settings
from ..base.backoff import Backoff, wait_until
from ..base.errors import NotInitializedError, ShutdownError
from ..base.from_thread import name_os_thread
from ..device import device
from ..engine import header_round, making, staging
from ..engine.join import join_lanes
from ..engine.operation import Lane
from ..engine.progress import Engine, EngineStatistics, ProgressPolicy
from ..engine.small_calls import SmallCalls, SmallCallStatistics
from ..sync import SyncPrimitives, SyncService
from ..transports.base import Backend
from . import failure
from .watchdog import Watchdog

log = logging.getLogger("asynclock")
T = TypeVar("T")
# How long the poller tests tightly after a synchronous (Horovod-style) call starts.
SYNC_EAGER_S = 5e-3
DRAIN_POLL_S = 1e-3  # `drain()` tests for an empty engine this often

_HOROVOD_ENV = ("HOROVOD_RANK", "HOROVOD_HOSTNAME", "HOROVOD_CONTROLLER")
# what an MPI launcher (mpirun, mpiexec, horovodrun --mpi, srun with PMI) gives each rank
_MPI_LAUNCHER_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def under_horovodrun() -> bool:
    """horovodrun exports HOROVOD_* variables to every worker (its Gloo mode does;
    its MPI mode runs `mpirun`, whose workers may carry none)."""
    return any(v in os.environ for v in _HOROVOD_ENV)


def mpi_world_launched() -> bool:
    """The ranks were started by an MPI launcher, so mpi4py sees the whole job."""
    controller = os.environ.get("HOROVOD_CONTROLLER", "").lower()
    if controller in ("gloo", "mpi"):  # gloo: mpi4py would see one singleton rank
        return controller == "mpi"
    return any(v in os.environ for v in _MPI_LAUNCHER_ENV)


def _horovod_importable() -> bool:
    try:
        import horovod.torch  # noqa: F401
    except Exception:
        return False
    return True


def _mpi_importable() -> bool:
    try:
        from mpi4py import MPI  # noqa: F401
    except Exception:
        return False
    return True


def choose_backend(name: str) -> str:
    """`auto`: Horovod under horovodrun without an MPI world (`--gloo`) when it
    imports, else MPI, else local.

    Where an MPI launcher started the ranks (`horovodrun --mpi` runs `mpirun`),
    MPI is chosen even under horovodrun: Horovod's background thread negotiates
    every cycle whether or not it has work (a large share of a core per rank on a
    small node: see the benchmarks page), and the MPI transport needs no Horovod.
    `ASYNCLOCK_BACKEND=horovod` still picks Horovod there.
    """
    name = settings.text("ASYNCLOCK_BACKEND") if name == "auto" else name
    if name != "auto":
        return name
    if under_horovodrun() and not mpi_world_launched() and _horovod_importable():
        return "horovod"
    return "mpi" if _mpi_importable() else "local"


def make_backend(name: str, comm: Any = None) -> Backend:
    """Instantiate a backend by name (a collective call on every rank)."""
    if name == "mpi":
        from ..transports.mpi import MPIBackend

        return MPIBackend(comm)
    if name == "local":
        from ..transports.local import LocalBackend

        return LocalBackend()
    if name == "horovod":
        from ..transports.horovod import HorovodBackend

        return HorovodBackend(comm)
    raise ValueError(f"unknown backend {name!r}: use auto, mpi, horovod or local")


class Coordinator(Collectives, SyncPrimitives):
    """One per rank: the backend, the progress engine and the channels.

    Its public attributes are the user face: collectives, cross-rank primitives,
    identity, process sets, the train step and the engine's life. Plumbing (the
    engine, its lanes, the hops from synchronous code to the loop) is under
    `lowlevel`, as `trio.lowlevel` holds trio's.

    Args:
        backend: this rank's transport, made collectively; `init()` and `start()` make
            it and the coordinator, which is how a program gets one.
        policy: the progress engine's knobs (None: `ProgressPolicy.from_env()`).
    """

    def __init__(self, backend: Backend, policy: ProgressPolicy | None = None) -> None:
        self._backend = backend
        self._engine = Engine(policy)
        header_round.yield_when_idle(backend.local_size > _cores())
        self._lane = self._new_lane("user", by_name=True)
        path = getattr(backend, "device_path", None)  # chosen with the first channel
        if path is not None and path.path == "gloo-twin":
            staging.use_cpu_twin()
        self._small = SmallCalls(self._engine, self._lane)
        self._grad_lane = self._new_lane("grad")
        # one per further optimizer, dropped ones included: every rank makes them alike,
        # but drops them when its collector runs, so join serves every one made
        self._more_grad_lanes: list[Lane] = []
        self._sync_lane = self._new_lane("sync")
        # collectives issued from inside a model (SyncBatchNorm), ordered by its layers
        self._model_lane = self._new_lane("model")
        self._loop_token: Any = None  # the caller's loop while `running()` (async API)
        self._loop_thread = 0
        self._closed = False
        self._engine_owner: str | None = None
        self._portal_cm: Any = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._lock = threading.Lock()
        self._watchdog = Watchdog.start_for(backend, self._engine, self.rank, self.size,
                                            reform=failure.policy() == "reform")
        self._lowlevel = Lowlevel(self)

    @property
    def lowlevel(self) -> Lowlevel:
        """The coordinator's plumbing: its progress engine, lanes and loop hops
        (asynclock's own layers use it; see `Lowlevel`)."""
        return self._lowlevel

    @property
    def backend(self) -> Backend:
        """The transport this rank uses, for diagnostics: `describe()` names it and
        its MPI; an MPI backend's `bulk_choice` and `refused_connections()` tell how
        large messages travel and which connections were refused."""
        return self._backend

    def _host(self) -> Lowlevel:
        return self._lowlevel  # what the sync primitives need (`sync.SyncHost`)

    def _new_lane(self, name: str, by_name: bool = False) -> Lane:
        return self._engine.add_lane(Lane(self._backend.channel(name), by_name))

    def _run_sync_then_start(self, fn: Callable[[], T]) -> T:
        returned = staging.Flag()

        async def go() -> T:
            with staging.holding(returned):
                return fn()

        try:
            return self._run_sync(go)
        finally:
            returned.set()
            engine = self._engine
            engine.call_soon_threadsafe(lambda: staging.release_ready(engine))

    async def join(self) -> int:
        """This rank has no more data: until every rank has joined, stand in for
        the others' allreduces and barriers.

        Stand-ins send identity data (zeros for sum and average, which still divides by
        the world size). Horovod's `hvd.join()`, DDP's `Join`.

        Returns:
            The rank that joined last.

        Raises:
            JoinedError: on every rank, for a collective that joined ranks cannot stand
                in for (broadcast, allgather, alltoall, ...), issued meanwhile.
            ShutdownError: the coordinator was shut down.
        """
        self._check_open()
        lanes = [self._lane, self._grad_lane, self._sync_lane, self._model_lane,
                 *self._more_grad_lanes]
        # A dropped optimizer's lane is no longer served here, but a peer whose
        # collector has not run yet still serves it: both stand in on it meanwhile.
        revived = [lane for lane in lanes if lane not in self._engine.lanes]
        for lane in revived:
            self._engine.add_lane(lane)
        with self._engine.holding(lanes):
            try:
                return await join_lanes(self._engine, lanes)
            finally:
                for lane in revived:
                    self._engine.retire_when_idle(lane)

    # -- process sets (api.process_sets) ---------------------------------
    async def process_set(self, ranks: Iterable[int]) -> Subset:
        """Collectives among `ranks` only: `(await coord.process_set([0, 2])).api`.

        Every rank calls it, in the same order (it splits a communicator); the
        others get a `Subset` that refuses calls by name.

        Args:
            ranks: the world ranks of the set (any order, duplicates ignored).

        Returns:
            The `Subset`: `.api` is its collective API on members, `.rank` this rank's
            number in it (-1 outside).

        Raises:
            InvalidInputError: the set is empty, or a rank is outside the world.
            NotImplementedError: the backend is not MPI.
            ShutdownError: the coordinator was shut down.
        """
        self._check_open()
        return await make_subset(self, ranks)

    async def remove_process_set(self, subset: Subset) -> None:
        """Finish the set's collectives in flight and free its channel (every rank
        calls it; idempotent).

        Args:
            subset: what `process_set` returned.
        """
        await remove_subset(self, subset)

    # -- identity ----------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank's index in the job, 0 to `size - 1`."""
        return self._backend.rank

    @property
    def size(self) -> int:
        """The number of ranks in the job."""
        return self._backend.size

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks on its host."""
        return self._backend.local_rank

    @property
    def local_size(self) -> int:
        """The number of ranks on this rank's host."""
        return self._backend.local_size

    @property
    def cross_rank(self) -> int:
        """This rank's index among the ranks that share its local rank, one per host."""
        return self._backend.cross_rank

    @property
    def cross_size(self) -> int:
        """The number of ranks that share this rank's local rank."""
        return self._backend.cross_size

    def statistics(self) -> EngineStatistics:
        """In-flight and completed counts of this rank's progress engine.

        Returns:
            The engine's exact counts (no communication).
        """
        return self._engine.statistics()

    def train_step(self, optimizer: Any, **options: Any) -> Any:
        """`async with coord.train_step(optimizer) as step:` (the torch integration's
        train step). Made once per optimizer and reused; imports torch only when called.

        Args:
            optimizer: the plain torch optimizer.
            **options: `asynclock.torch.TrainStep`'s keyword arguments (`model`, `op`,
                `tuning`, ...).

        Returns:
            The optimizer's `asynclock.torch.TrainStep` on this coordinator.

        Raises:
            RuntimeError: the torch integration is not importable.
            ValueError: invalid options, or other options than the step was made with.
        """
        if not _TRAIN_STEP:
            raise RuntimeError("train_step needs the torch integration (asynclock.torch)")
        return _TRAIN_STEP[0](self, optimizer, **options)

    def _check_open(self) -> None:
        if self._closed:
            raise ShutdownError("asynclock coordinator was shut down; call init()/start() again")

    # -- running the engine on the caller's loop ----------------------------------
    @asynccontextmanager
    async def running(self) -> AsyncIterator[Coordinator]:
        """Run the progress engine on the current loop for the block's duration.

        Leaving the block drains what this rank started; `async with coord:` is the same.

        Yields:
            This coordinator.

        Raises:
            RuntimeError: the engine already runs on another loop or the loop thread.
            ShutdownError: the coordinator was shut down.
        """
        self._check_open()
        self._claim("loop")
        self._loop_token = anyio.lowlevel.current_token()
        self._loop_thread = threading.get_ident()
        body_error: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self._engine.run)
                await tg.start(self._service.run)
                try:
                    yield self
                    await self.drain()
                except BaseException as exc:  # re-raised bare, not in an ExceptionGroup
                    body_error = exc
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self._engine_owner, self._loop_token = None, None
        if body_error is not None:
            raise body_error

    def _claim(self, owner: str) -> None:
        """One engine per coordinator: two loops would race on collective order."""
        with self._lock:
            if self._engine_owner is not None:
                raise RuntimeError(f"the progress engine already runs on the {self._engine_owner}")
            self._engine_owner = owner

    async def drain(self, timeout: float = 60.0) -> None:
        """Wait until every started collective completed on this rank. Every rank
        drains together (shutdown, removing a process set), so calls that some
        ranks issued and others never will fail now (`UnmatchedError`).

        Args:
            timeout: seconds to wait.

        Raises:
            TimeoutError: collectives were still in flight after `timeout`.
        """
        self._engine.close_matching()
        with anyio.fail_after(timeout):
            await wait_until(lambda: not self._engine.inflight, Backoff.every(DRAIN_POLL_S))

    def _call_blocking(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        token = self._loop_token
        if token is None:
            return self._run_sync(fn, *args)
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("a blocking collective on the event loop's thread would block "
                               "the loop: run this code in a worker thread "
                               "(await anyio.to_thread.run_sync(...))")
        result: T = anyio.from_thread.run(fn, *args, token=token)  # type: ignore[arg-type]
        return result

    # -- synchronous use (Horovod style) ------------------------------------------
    def _run_sync(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if self._loop_token is not None:  # the async API runs the engine: go through it
            return self._call_blocking(fn, *args)
        result: T = self._sync_portal().call(self._eagerly, fn, *args)
        return result

    async def _eagerly(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        engine = self._engine
        engine.eager_until = time.perf_counter() + SYNC_EAGER_S
        engine.blocked_callers += 1
        try:
            return await fn(*args)
        finally:
            engine.blocked_callers -= 1

    def _sync_portal(self) -> anyio.from_thread.BlockingPortal:
        self._check_open()
        if self._portal is None:
            self._claim("sync loop thread")
            self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
            self._portal = self._portal_cm.__enter__()
            # anyio refuses start_task_soon on the loop thread: start the portal-owned
            # tasks from this thread, then wait on the loop until they run.
            self._portal.start_task_soon(self._engine.run)
            self._portal.start_task_soon(self._service.run)
            self._portal.call(self._start_engine_task)
            self._portal.call(name_os_thread, "asynclock-loop")
        return self._portal

    async def _start_engine_task(self) -> None:
        """Inside the portal loop: wait until the portal-owned tasks run."""
        await wait_until(lambda: self._engine.running and self._service.running, Backoff.every(0.0))

    def shutdown(self) -> None:
        """Drain in-flight work, stop the loop thread and free communicators."""
        if self._closed:
            return
        if self._portal is not None:
            self._portal.call(self.drain)
            self._portal.call(self._portal.stop, True)  # the engine tasks run until cancelled
            self._portal_cm.__exit__(None, None, None)
            self._portal = None
            self._engine_owner = None
        if self._engine.inflight:
            log.warning("asynclock shutdown with %d collectives in flight",
                        len(self._engine.inflight))
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.close()  # tells the peers `closing` before the comms go
        self._backend.shutdown()
        if self is _global:
            settings.forget()

    def _abandon(self, error: BaseException, lost: bool = True) -> None:
        if self._closed:
            return
        engine = self._engine
        if self._portal is not None:
            self._portal.call(engine.fail_all, error)
            self._portal.call(self._portal.stop, True)
            self._portal_cm.__exit__(None, None, None)
            self._portal, self._engine_owner = None, None
        elif engine.failure is None:
            engine.fail_all(error)  # no loop runs it (the async API left `running()`)
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.close()  # says `closing` unless it already gave its verdict
        self._backend.shutdown(lost=lost)
        if self is _global:
            settings.forget()

    async def __aenter__(self) -> Coordinator:
        self._running_cm = self.running()
        return await self._running_cm.__aenter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._running_cm.__aexit__(*exc)


class Lowlevel:
    """`coord.lowlevel`: the coordinator's plumbing, kept off its user face (as
    `trio.lowlevel` and `anyio.lowlevel` keep theirs). asynclock's own layers use
    it: the Horovod drop-in's hops from synchronous code to the loop, the gradient
    engine's lanes, process sets, checkpoints and elastic jobs; so may a tool that
    extends asynclock. Nothing here checks its input across ranks the way the
    collectives do."""

    __slots__ = ("_coord",)

    def __init__(self, coord: Coordinator) -> None:
        self._coord = coord

    # -- the engine and its lanes --------------------------------------------------
    @property
    def engine(self) -> Engine:
        """This rank's progress engine (`engine.progress`)."""
        return self._coord._engine

    @property
    def user_lane(self) -> Lane:
        """The lane of the coordinator's own collectives, matched by name."""
        return self._coord._lane

    @property
    def grad_lane(self) -> Lane:
        """The first gradient reducer's lane."""
        return self._coord._grad_lane

    @property
    def more_grad_lanes(self) -> list[Lane]:
        """One lane per further gradient reducer, dropped ones included (join serves
        every one: peers drop them at different times)."""
        return self._coord._more_grad_lanes

    @property
    def sync_lane(self) -> Lane:
        """The cross-rank primitives' messages (`sync`)."""
        return self._coord._sync_lane

    @property
    def model_lane(self) -> Lane:
        """Collectives issued from inside a model (SyncBatchNorm), in its layers' order."""
        return self._coord._model_lane

    @property
    def sync(self) -> SyncService:
        """The sync lane's message pump; it runs with the engine on every rank."""
        return self._coord._service

    @property
    def watchdog(self) -> Watchdog | None:
        """The heartbeat watchdog (None in a one-rank world)."""
        return self._coord._watchdog

    def add_lane(self, channel: Any, by_name: bool = False) -> Lane:
        """Serve `channel` (made collectively, e.g. a process set's) on this engine;
        `by_name`: the user's calls, matched by name once ranks disagree."""
        return self._coord._engine.add_lane(Lane(channel, by_name))

    async def make_lanes(self, what: str, channels: Callable[[], Sequence[Any] | None],
                         by_name: Sequence[bool], ranks: tuple[int, ...] = ()
                         ) -> list[Lane] | None:
        """Channels made after start-up (`engine.making`), served as lanes: agreed on the
        user lane as a make of `what` for `ranks`, then `channels()` (a collective over
        the world: None on ranks it leaves out) and each lane's own set-up run on a
        wait thread. Every rank calls it, in the same order."""
        coord = self._coord
        coord._check_open()

        def build() -> list[Lane] | None:
            made = channels()
            if made is None:
                return None
            return [Lane(ch, named) for ch, named in zip(made, by_name, strict=True)]

        def discard(lanes: list[Lane] | None) -> None:
            for lane in lanes or ():
                coord.backend.close_channel(lane.transport)

        engine = coord._engine
        lanes = await making.make(engine, coord._lane, what, build, ranks=ranks,
                                  discard=discard)
        for lane in lanes or ():
            if lane not in engine.lanes:  # a second caller of the same make
                engine.add_lane(lane)
        return lanes

    def remove_lane(self, lane: Lane) -> None:
        """Stop serving a lane with nothing in flight and free its channel."""
        self._coord._engine.retire_lane(lane)
        self._coord.backend.close_channel(lane.transport)

    def on_lane(self, lane: Lane) -> LaneCollectives:
        """The collective API on another lane (e.g. `grad_lane`)."""
        return LaneCollectives(self._coord._engine, lane, self._coord._check_open)

    def small_path_statistics(self) -> SmallCallStatistics:
        """User-lane calls on the small-message path (`engine.small_calls`), and hand-offs."""
        return self._coord._small.statistics()

    # -- from synchronous code -------------------------------------------------------
    def run_sync(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `fn(*args)` on the engine's private loop thread and wait for it.

        The caller's thread is blocked meanwhile, so latency is all that counts:
        the poller tests tightly for `SYNC_EAGER_S` instead of backing off to
        1 ms sleeps, which would add most of a sleep to every small call, and
        past that never sleeps longer than `blocked_max_sleep_s` while it waits.
        """
        return self._coord._run_sync(fn, *args)

    def run_sync_then_start(self, fn: Callable[[], T]) -> T:
        """`fn()` on the loop thread; the collectives it submits start only once
        the caller has the result (how `hvd.*_async` returns before its
        collective starts, so `poll()` right after it says False, as on Horovod).
        A name already in use or bad input still raises here, before anything
        is sent."""
        return self._coord._run_sync_then_start(fn)

    def call_blocking(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `fn(*args)` on whichever loop runs the engine and wait for it: for
        synchronous code that needs a collective (a layer's forward or backward).

        Never on that loop's own thread: the wait would block the loop."""
        return self._coord._call_blocking(fn, *args)

    def abandon(self, error: BaseException, lost: bool = True) -> None:
        """Leave this world without draining it: it `lost` a rank, or the job re-forms
        (`runtime.elastic`). Every operation in flight, and every later call, fails
        with `error`; the loop thread, the watchdog and the backend stop (Horovod too,
        when asynclock started it), and the process goes on."""
        self._coord._abandon(error, lost)


# -- what layers above provide ---------------------------------------------------------
# The core does not import the torch integration: the public face (`asynclock/__init__`)
# registers how `train_step` is made.
_TRAIN_STEP: list[Callable[..., Any]] = []


def use_train_step(factory: Callable[..., Any]) -> None:
    """`factory(coord, optimizer, **options)` makes `coord.train_step(...)`'s step."""
    _TRAIN_STEP[:] = [factory]


# -- process-wide coordinator (Horovod style) ------------------------------------
_global: Coordinator | None = None


def init(backend: str = "auto", *, comm: Any = None,
         policy: ProgressPolicy | None = None) -> Coordinator:
    """Create this rank's coordinator (idempotent), like `hvd.init()`.

    A collective: every rank calls it. Every ASYNCLOCK_* setting is read and checked
    here, once; settings that must agree are compared across ranks.

    Args:
        backend: "auto" (ASYNCLOCK_BACKEND, else Horovod under `horovodrun --gloo`, MPI
            where mpi4py imports, one local rank otherwise), "mpi", "horovod" or "local".
        comm: an mpi4py communicator to run on (None: the whole MPI world).
        policy: the progress engine's knobs (None: `ProgressPolicy.from_env()`).

    Returns:
        The process-wide coordinator (the running one, if any).

    Raises:
        ValueError: `backend` is unknown, or an ASYNCLOCK_* value is invalid.
        MismatchError: on every rank, where settings that must agree differ.
        CollectiveTimeout: not every rank joined the start-up agreement in time.
    """
    global _global
    if _global is None or _global._closed:
        settings.load()  # every ASYNCLOCK_* setting is read and checked here, once
        chosen = choose_backend(backend)
        _global = Coordinator(make_backend(chosen, comm), policy)
        agree_config(_global._engine, _global._lane, _global.backend.name)
        failure.install_excepthook(_global.rank, _global.size, _live_rank)
        if _global.rank == 0:
            log.info("asynclock backend: %s", _global.backend.describe())
    return _global


def coordinator() -> Coordinator:
    """The coordinator made by `init()`/`start()`.

    Returns:
        The process-wide coordinator.

    Raises:
        NotInitializedError: before `init()`/`start()`.
        ShutdownError: after `shutdown()`.
    """
    if _global is None:
        raise NotInitializedError("asynclock is not initialized: call asynclock.init() "
                                  "or use `async with asynclock.start()`")
    if _global._closed:
        raise ShutdownError("asynclock was shut down; call asynclock.init() again")
    return _global


def is_initialized() -> bool:
    """Whether a coordinator is running, like `hvd.is_initialized()`.

    Returns:
        True between `init()`/`start()` and `shutdown()`.
    """
    return _global is not None and not _global._closed


def shutdown() -> None:
    """Shut the process-wide coordinator down (idempotent)."""
    global _global
    if _global is not None:
        _global.shutdown()
        _global = None


@asynccontextmanager
async def start(backend: str = "auto", *, comm: Any = None,
                policy: ProgressPolicy | None = None,
                shutdown_on_exit: bool = True) -> AsyncIterator[Coordinator]:
    """`async with asynclock.start() as coord:` on asyncio or trio.

    Creating communicators is a blocking collective, so it runs in a worker
    thread: the loop (and the user's side tasks) stay live while late ranks
    arrive. The progress engine runs on the caller's loop for the block; an error that
    leaves the block stops every rank (ASYNCLOCK_ON_ERROR).

    Args:
        backend: "auto" (ASYNCLOCK_BACKEND, else Horovod under `horovodrun --gloo`, MPI
            where mpi4py imports, one local rank otherwise), "mpi", "horovod" or "local".
        comm: an mpi4py communicator to run on (None: the whole MPI world).
        policy: the progress engine's knobs (None: `ProgressPolicy.from_env()`).
        shutdown_on_exit: shut the coordinator down when the block ends (False: keep
            it for a later `start()` or synchronous calls).

    Yields:
        The running coordinator.

    Raises:
        ValueError: `backend` is unknown, or an ASYNCLOCK_* value is invalid.
        MismatchError: on every rank, where settings that must agree differ.
        CollectiveTimeout: not every rank joined the start-up agreement in time.
    """
    coord = _global if is_initialized() else None
    if coord is None:
        coord = await anyio.to_thread.run_sync(lambda: init(backend, comm=comm, policy=policy))
    try:
        async with coord.running():
            yield coord
    except BaseException as exc:
        # by default: stop every rank, print once
        failure.on_uncaught(coord.rank, coord.size, coord._watchdog, exc)
        raise
    finally:
        if shutdown_on_exit:
            await anyio.to_thread.run_sync(shutdown)


def rank() -> int:
    """This process's rank in the job, 0 to `size() - 1`, like `hvd.rank()`.

    Returns:
        This process's rank in the job, 0 to `size() - 1`.

    Raises:
        NotInitializedError: before `init()`/`start()`.
    """
    return coordinator().rank


def size() -> int:
    """The number of ranks in the job, like `hvd.size()`.

    Returns:
        The number of ranks in the job.

    Raises:
        NotInitializedError: before `init()`/`start()`.
    """
    return coordinator().size


def local_rank() -> int:
    """This rank's index among the ranks on its host, like `hvd.local_rank()`
    (`asynclock.cuda.set_device` picks the GPU from it).

    Returns:
        This rank's index on its host.

    Raises:
        NotInitializedError: before `init()`/`start()`.
    """
    return coordinator().local_rank


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def local_size() -> int:
    """The number of ranks on this rank's host, like `hvd.local_size()`.

    Returns:
        The number of ranks on this rank's host.

    Raises:
        NotInitializedError: before `init()`/`start()`.
    """
    return coordinator().local_size


def cross_rank() -> int:
    """This rank's index among the ranks that share its local rank, one per host (the
    host's index when every host runs as many ranks), like `hvd.cross_rank()`.

    Returns:
        This rank's index among the ranks of its local rank.

    Raises:
        NotInitializedError: before `init()`/`start()`.
    """
    return coordinator().cross_rank


def cross_size() -> int:
    """The number of ranks that share this rank's local rank (the number of hosts when
    every host runs as many ranks), like `hvd.cross_size()`.

    Returns:
        The number of ranks of this rank's local rank.

    Raises:
        NotInitializedError: before `init()`/`start()`.
    """
    return coordinator().cross_size


def _local_rank_if_running() -> int | None:
    return local_rank() if is_initialized() else None


device.use_local_rank(_local_rank_if_running)


def _live_rank() -> tuple[int, int, Watchdog | None] | None:
    """The open process-wide coordinator's rank, size and watchdog (the excepthook's)."""
    coord = _global
    return None if coord is None or coord._closed else (coord.rank, coord.size, coord._watchdog)
