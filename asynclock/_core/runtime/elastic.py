"""Elastic jobs: a rank that dies or is cut off ends the world, not the job.

Under Horovod's elastic launcher (`horovodrun --gloo --min-np N --max-np M
[--host-discovery-script S]`) the failure policy is `reform`
(`failure.policy`). The survivors keep their processes and their memory:

1. the loss fails every collective in flight, and every later one, on every
   survivor with the same `RankFailedError` (the watchdog names the lost rank
   and relays its words: `runtime.watchdog`);
2. `lost_world` tells that error from the program's own (a mismatch, a bad
   input), which still stop the job as they always do;
3. `reform` abandons the coordinator (its engine, wait threads, meshes, and
   Horovod) and makes a new one on the world Horovod's driver forms from the
   live ranks: new ranks, new channels, new meshes, a new job secret;
4. the training loop then restores the last committed state in memory, and
   syncs it from the new rank 0, which is the lowest surviving rank (the
   driver keeps the surviving hosts first).

`run` is Horovod's `hvd.elastic.run` decorator for synchronous programs;
`run_elastic` is its async form, for custom loops on asyncio or trio: the
loop and every task beside the training function (logging, evaluation,
prefetch) live on through a reset, since the old world is torn down and the
new one made in worker threads.

Hosts that the discovery script adds join at the next commit: the driver
tells rank 0 (`transports.horovod_elastic`), and `State.check_host_updates`
broadcasts what rank 0 heard, so every rank raises `HostsUpdatedInterrupt`
at the same commit and re-forms with the newcomers, who get the state by
the sync. The torch integration registers what a reset must do to its
gradient machinery (`use_reform_hooks`).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import queue
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from ..base import settings
from ..base.backoff import Backoff, poll_until
from ..base.errors import BackendError, HostsUpdatedInterrupt, RankFailedError
from ..engine.progress import ProgressPolicy
from ..transports.horovod_elastic import REMOVED, driver_unreachable, listen_for_host_updates
from . import coordinator as runtime
from . import failure
from .exits import EXIT_RANK_FAILED, hard_exit, write_stderr

log = logging.getLogger("asynclock")
T = TypeVar("T")
NAME_POLL_S = 0.01  # how often a survivor looks for its watchdog's verdict
REFORM_POLL_S = 0.1  # how often the main thread looks up from waiting for a new world
HOSTS_CALL = "asynclock.elastic.hosts"  # the commit's broadcast of rank 0's host news

Hook = Callable[[runtime.Coordinator], None]
_leaving: list[Hook] = []
_joined: list[Hook] = []


def use_reform_hooks(leaving: Hook, joined: Hook) -> None:
    """`leaving(old)` runs before a world is abandoned, `joined(new)` once the new
    one stands (the torch integration: detach and rebuild its reducers)."""
    if leaving not in _leaving:
        _leaving.append(leaving)
    if joined not in _joined:
        _joined.append(joined)


# -- telling a lost world from the program's own error ---------------------------------
def _ends_world(exc: BaseException) -> bool:
    """A lost rank, a broken link, or Horovod shut down under us, anywhere in the
    chain of causes (the gradient reducer wraps its buckets' errors)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (RankFailedError, BackendError)):
            return True
        if type(exc).__name__ == "HorovodInternalError" and type(exc).__module__.startswith(
                "horovod"):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside `exc` (a task group's exception group, flattened; told by
    its `exceptions` tuple, as Python 3.10 has the group only as a backport)."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple):
        for each in inner:
            yield from _leaves(each)
    else:
        yield exc


def lost_world(exc: BaseException) -> RankFailedError | None:
    """The error every survivor raises for this world's loss, if `exc` comes from
    it (else None: the program's own error, which propagates).

    A collective can fail on the broken link itself before the watchdog names
    the lost rank: then wait up to `ASYNCLOCK_ELASTIC_NAME_S` for its verdict,
    so that every survivor reports the same error.
    """
    if failure.policy() != "reform" or not any(_ends_world(e) for e in _leaves(exc)):
        return None
    coord = runtime._global
    dog = coord.lowlevel.watchdog if coord is not None else None
    if dog is not None:
        dog.check_now()
        poll_until(lambda: dog.lost is not None, Backoff.every(NAME_POLL_S),
                   settings.number("ASYNCLOCK_ELASTIC_NAME_S"))
        if dog.lost is not None:
            return dog.lost
    first = next(e for e in _leaves(exc) if _ends_world(e))
    return first if isinstance(first, RankFailedError) else RankFailedError(
        f"the job's world broke: {failure.summary(first)}")


def reform(lost: RankFailedError | None = None) -> runtime.Coordinator:
    """Abandon the process-wide coordinator and make one on the world that Horovod's
    driver forms now (a blocking collective across the new world: call it from a
    thread, never from the event loop). `lost`: why (None: hosts were updated)."""
    old = runtime._global
    if old is None:
        raise RuntimeError("reform() needs a coordinator: call init() first")
    if os.environ.get(failure.ELASTIC_LAUNCHER_ENV) != "1":  # MPI worlds are static
        raise lost or RankFailedError("the job cannot re-form: start it with Horovod's "
                                      "elastic launcher (horovodrun --gloo --min-np N, or "
                                      "python -m asynclock.launch --elastic)")
    reason = lost or RankFailedError("the job re-forms: hosts were added or removed")
    for hook in _leaving:
        hook(old)
    policy: ProgressPolicy = old.lowlevel.engine.policy
    rank = old.rank
    old.lowlevel.abandon(reason, lost=lost is not None)
    what = f" after {lost}" if lost is not None else ""
    cut_off = driver_unreachable(dict(os.environ), settings.number("ASYNCLOCK_DEAD_AFTER_S"))
    if cut_off is not None:
        write_stderr(f"asynclock[rank {rank}]: this rank leaves the job{what}: {cut_off}, "
                     "so it is cut off; the others re-form without it\n")
        hard_exit(EXIT_RANK_FAILED)
    try:
        new = _new_world(policy, lambda: _ended(rank, what))
    except Exception as exc:
        raise RankFailedError(f"the job could not re-form{what}: {exc}") from exc
    for hook in _joined:
        hook(new)
    if new.rank == 0:
        log.info("asynclock: the job re-formed with %d ranks", new.size)
    return new


def _new_world(policy: ProgressPolicy, on_sigterm: Callable[[], None]) -> runtime.Coordinator:
    """`runtime.init` for the world the driver forms now. On the main thread the wait
    runs in a thread of its own: Horovod's init blocks in C, where no Python signal
    handler runs, and the driver ends a job that cannot re-form with SIGTERM, which
    must then say what happened (`on_sigterm`)."""
    if threading.current_thread() is not threading.main_thread():
        return runtime.init(policy=policy)
    made: list[runtime.Coordinator] = []
    failed: list[BaseException] = []

    def make() -> None:
        try:
            made.append(runtime.init(policy=policy))
        except BaseException as exc:
            failed.append(exc)

    waiter = threading.Thread(target=make, name="asynclock-reform", daemon=True)
    previous = signal.signal(signal.SIGTERM, lambda _sig, _frame: on_sigterm())
    try:
        waiter.start()
        while waiter.is_alive():
            waiter.join(REFORM_POLL_S)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failed:
        raise failed[0]
    return made[0]


def _ended(rank: int, what: str) -> None:
    """SIGTERM while waiting for the new world: Horovod's driver gave up on it."""
    write_stderr(f"asynclock[rank {rank}]: the job could not re-form{what}: it was ended "
                 "while this rank waited for the new world (Horovod's elastic driver ends "
                 "the job when fewer than --min-np ranks are left once --elastic-timeout "
                 "has passed)\n")
    hard_exit(EXIT_RANK_FAILED)


# -- the state a job keeps across resets ----------------------------------------------------
class State:
    """What an elastic job keeps in memory across a reset: `commit()` saves it,
    `restore()` rolls back to the last commit, `sync()` copies rank 0's committed
    state to every rank. Subclasses say what to save, restore and sync.

    `commit()` also checks for hosts the driver added or removed, and raises
    `HostsUpdatedInterrupt` on every rank at the same commit when there are.
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self._host_notes: queue.SimpleQueue[tuple[float, int]] = queue.SimpleQueue()
        self._last_note = 0.0

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of `callbacks` after every reset (e.g. to scale the learning rate
        with the new world size), before the state is synced.

        Args:
            callbacks: functions of no arguments, called in order; added to those
                registered before.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """The world was re-formed: drop host notes of the old one, then `reset()`
        and the callbacks."""
        self._host_notes = queue.SimpleQueue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: int) -> None:
        """Horovod's driver reports a host change (on its notification thread).

        Args:
            timestamp: when the driver saw the change; a later commit acts on notes
                newer than the last one acted on.
            update_res: what changed, as Horovod's `HostUpdateResult` flags (added,
                removed or both).
        """
        self._host_notes.put((timestamp, int(update_res)))

    def commit(self) -> None:
        """Save the state in memory, then `check_host_updates()`."""
        self.save()
        self.check_host_updates()

    async def commit_async(self) -> None:
        """`commit()` on the event loop (the async API)."""
        self.save()
        await self.check_host_updates_async()

    def check_host_updates(self) -> None:
        """Raise `HostsUpdatedInterrupt` on every rank when hosts were added or removed
        (a collective: every rank calls it at the same point; rank 0's notes decide).

        Raises:
            HostsUpdatedInterrupt: on every rank, where rank 0 heard of a host change
                since the last check.
        """
        runtime.coordinator().lowlevel.run_sync(self.check_host_updates_async)

    async def check_host_updates_async(self) -> None:
        """`check_host_updates()` on the event loop (the async API)."""
        seen = newest = self._last_note
        what = 0
        while not self._host_notes.empty():
            stamp, res = self._host_notes.get()
            if stamp > newest:
                newest, what = stamp, what | res
        # Only rank 0 hears from the driver: its notes decide on every rank at once,
        # a rank that joined later (which has seen no note at all) included.
        seen, newest, what = await runtime.coordinator().broadcast_object(
            (seen, newest, what), root=0, name=HOSTS_CALL)
        self._last_note = newest
        if newest > seen:
            raise HostsUpdatedInterrupt(skip_sync=what == REMOVED)

    def sync(self) -> None:
        """Copy rank 0's committed state to every rank (a collective)."""
        runtime.coordinator().lowlevel.run_sync(self.sync_async)

    async def sync_async(self) -> None:
        """`sync()` on the event loop (the async API)."""
        raise NotImplementedError

    def save(self) -> None:
        """Keep the current state in memory as the last commit."""
        raise NotImplementedError

    def restore(self) -> None:
        """Roll back to the last commit."""
        raise NotImplementedError

    def reset(self) -> None:
        """After a reset, before the callbacks and the sync (e.g. re-shard data)."""


class ObjectState(State):
    """Plain Python values, given as keyword arguments and kept as attributes:
    `state = ObjectState(epoch=0, batch=0)`, then `state.batch += 1`. A commit keeps
    a deep copy, so a value changed in place after it is rolled back too.

    Args:
        **values: the values, by attribute name; each is deep-copied at a commit and
            broadcast from rank 0 (pickled) at a sync.
    """

    def __init__(self, **values: Any) -> None:
        self._saved = copy.deepcopy(values)
        super().__init__()
        self._put(values)

    def _put(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            setattr(self, name, value)

    def save(self) -> None:
        self._saved = copy.deepcopy({name: getattr(self, name) for name in self._saved})

    def restore(self) -> None:
        self._put(copy.deepcopy(self._saved))

    async def sync_async(self) -> None:
        if self._saved:
            self._saved = await runtime.coordinator().broadcast_object(self._saved, root=0)
            self._put(copy.deepcopy(self._saved))


# -- running a training function through resets ---------------------------------------------
@contextmanager
def _host_notes_to(state: State) -> Iterator[None]:
    stop = listen_for_host_updates(state, dict(os.environ))
    try:
        yield
    finally:
        stop()


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Horovod's `hvd.elastic.run`: `func(state, *args)` runs until it returns; when
    the world is lost it runs again on the re-formed world, from the last commit
    (`state.restore()`), and when hosts were updated, from the commit that noticed.

    Before each run the state is synced from rank 0 (skipped when hosts were only
    removed, as every rank then holds it already). Errors of the program's own
    propagate, as they would without it.

    Args:
        func: the training function; its first argument is the `State`.

    Returns:
        A function of `(state, *args, **kwargs)` that returns what `func` returns.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        skip_sync = False
        with _host_notes_to(state):
            while True:
                lost: RankFailedError | None = None
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HostsUpdatedInterrupt as exc:
                    skip_sync = exc.skip_sync
                except Exception as exc:
                    lost = lost_world(exc)
                    if lost is None:
                        raise
                    state.restore()
                    skip_sync = False
                reform(lost)
                state.on_reset()

    return wrapper


async def run_elastic(func: Callable[..., Awaitable[T]], state: State, *args: Any,
                      backend: str = "auto", policy: ProgressPolicy | None = None) -> T:
    """The async form of `run`: `await asynclock.run_elastic(train, state)` runs
    `await train(coord, state, *args)` on this loop, with the engine on it, until
    it returns; a lost world or updated hosts make it run again on the new world's
    coordinator, from the last commit. Use `await state.commit_async()` in `train`.

    The loop, and every task beside `train`, go on through a reset: the old world
    is torn down, and the new one made, in worker threads. An error of the
    program's own stops the job as under `asynclock.start()`; the coordinator is
    shut down when this returns.

    Args:
        func: `async def train(coord, state, *args)`, run with each world's coordinator.
        state: what the job keeps across resets; synced from rank 0 before each run.
        *args: passed on to `func` after `coord` and `state`.
        backend: as in `asynclock.init`: "auto", "mpi", "horovod" or "local".
        policy: the progress engine's knobs (None: `ProgressPolicy.from_env()`).

    Returns:
        What `func` returns.
    """
    skip_sync = False
    try:
        with _host_notes_to(state):
            while True:
                coord = await anyio.to_thread.run_sync(
                    functools.partial(runtime.init, backend, policy=policy))
                lost: RankFailedError | None = None
                try:
                    async with coord.running():
                        if not skip_sync:
                            await state.sync_async()
                        return await func(coord, state, *args)
                except Exception as exc:
                    interrupt = _interrupt_in(exc)
                    if interrupt is not None:
                        skip_sync = interrupt.skip_sync
                    else:
                        lost = await anyio.to_thread.run_sync(lost_world, exc)
                        if lost is None:
                            raise
                        state.restore()
                        skip_sync = False
                await anyio.to_thread.run_sync(reform, lost)
                state.on_reset()
    except BaseException as exc:
        live = runtime._global
        if live is not None and not live._closed:
            failure.on_uncaught(live.rank, live.size, live.lowlevel.watchdog, exc)
        raise
    finally:
        await anyio.to_thread.run_sync(runtime.shutdown)


def _interrupt_in(exc: BaseException) -> HostsUpdatedInterrupt | None:
    """The `HostsUpdatedInterrupt` that `exc` is or holds (a task group's), if any."""
    return next((e for e in _leaves(exc) if isinstance(e, HostsUpdatedInterrupt)), None)
