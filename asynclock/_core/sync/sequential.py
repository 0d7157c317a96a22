"""Sequential sections: `async with coord.sequential("name"):` runs the body on
rank 0, then rank 1, ..., then rank 0 again for the next round.

A token travels round the ring: leaving the section in round g sends it to
the next rank (the last rank sends round g+1 to rank 0). Each entry on a
rank takes the next round, so several tasks of one rank take successive
rounds, and every rank must enter the same number of times (a collective).
A task cancelled before its turn gives the turn up: the token is passed on
as soon as it arrives, so the ring never stops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ..base.errors import CollectiveTimeout, RankFailedError
from ._wire import M, object_id

if TYPE_CHECKING:
    from ._service import SyncService

log = logging.getLogger("asynclock.sync")


@dataclass(frozen=True, slots=True)
class SequentialStatistics:
    name: str
    next_round: int
    entered: int
    skipped: int
    tasks_waiting: int


class Sequential:
    """Ranks take turns in rank order, once per round.

    Made by `coord.sequential(name)`; `async with seq:` enters and leaves.

    Args:
        service: this rank's sync service; `coord.sequential(name)` passes it, and gives
            every task of the rank the same object for one name.
        name: the section's name; the same name is the same section on every rank.
    """

    def __init__(self, service: SyncService, name: str) -> None:
        self._svc = service
        self.name = name
        self.obj = object_id("sequential", name)
        self._next = 0
        self._allowed: set[int] = {0} if service.rank == 0 else set()
        self._skip: set[int] = set()
        self._waiters: dict[int, anyio.Event] = {}
        self._inside: list[int] = []
        self._entered = self._skipped = 0
        for g in service.early_tokens.pop(self.obj, []):
            self._allowed.add(g)
        service.token_sinks[self.obj] = self._on_token

    @property
    def predecessor(self) -> int:
        """The rank whose turn comes just before this rank's."""
        return (self._svc.rank - 1) % self._svc.size

    def _on_token(self, generation: int) -> None:
        if generation in self._skip:
            self._skip.discard(generation)
            self._pass(generation)
            return
        self._allowed.add(generation)
        event = self._waiters.pop(generation, None)
        if event is not None:
            event.set()

    def _pass(self, generation: int) -> None:
        """Hand the turn on: next rank, same round; the last rank starts the next round."""
        svc = self._svc
        nxt, gen = svc.rank + 1, generation
        if nxt == svc.size:
            nxt, gen = 0, generation + 1
        svc.send(nxt, (int(M.TOKEN), self.obj, 0, gen))

    async def enter(self, timeout: float | None = None) -> int:
        """Wait for this rank's turn. Cancelled before it: the turn is given up.

        Args:
            timeout: seconds to wait; None waits for ever (stalls are still probed).

        Returns:
            The round entered (0, 1, ...).

        Raises:
            CollectiveTimeout: the turn did not come within `timeout`; it is given up.
            RankFailedError: the predecessor did not answer a liveness probe.
        """
        gen, self._next = self._next, self._next + 1
        if gen not in self._allowed:
            await self._await_turn(gen, timeout)
        self._allowed.discard(gen)
        self._inside.append(gen)
        self._entered += 1
        return gen

    async def _await_turn(self, gen: int, timeout: float | None) -> None:
        event = self._waiters[gen] = anyio.Event()
        try:
            with anyio.fail_after(timeout):
                while not event.is_set():
                    with anyio.move_on_after(self._svc.policy.stall_s):
                        await event.wait()
                    if not event.is_set():
                        await self._stalled(gen)
        except BaseException as exc:
            self._give_up(gen)
            if isinstance(exc, TimeoutError):
                raise CollectiveTimeout(self._late(gen, timeout)) from None
            raise

    def _give_up(self, gen: int) -> None:
        self._waiters.pop(gen, None)
        self._skipped += 1
        if gen in self._allowed:
            self._allowed.discard(gen)
            self._pass(gen)
        else:
            self._skip.add(gen)

    def _late(self, gen: int, timeout: float | None) -> str:
        return (f"sequential {self.name!r}: rank {self._svc.rank}'s turn in round {gen} did "
                f"not come within {timeout:g} s (waiting for rank {self.predecessor}); "
                f"the turn was given up")

    async def _stalled(self, gen: int) -> None:
        p = self.predecessor
        if not await self._svc.alive(p):
            raise RankFailedError(
                f"sequential {self.name!r}: rank {p}, whose turn comes before rank "
                f"{self._svc.rank}'s in round {gen}, did not answer a liveness probe within "
                f"{self._svc.policy.probe_s:g} s (dead, or its event loop is blocked)")
        log.warning("sequential %r: rank %d still waiting for its turn in round %d",
                    self.name, self._svc.rank, gen)

    def leave(self) -> None:
        """End this rank's turn (the earliest round entered and not yet left).

        Raises:
            RuntimeError: no round was entered.
        """
        if not self._inside:
            raise RuntimeError(f"sequential {self.name!r}: leave() without enter()")
        self._pass(self._inside.pop(0))

    async def __aenter__(self) -> int:
        return await self.enter()

    async def __aexit__(self, *exc: Any) -> None:
        self.leave()

    def statistics(self) -> SequentialStatistics:
        """This rank's counters; no messages.

        Returns:
            Name, next round, rounds entered and skipped, tasks waiting.
        """
        return SequentialStatistics(self.name, self._next, self._entered, self._skipped,
                                    len(self._waiters))
