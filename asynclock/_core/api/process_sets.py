"""Collectives among a subset of ranks (Horovod's process sets), on a channel of their own.

Making a set is collective over the whole world, in the same order on every
rank, and runs as a checked call (`engine.making`): the ranks first agree on
the set on the user lane, then the backend splits its world communicator on a
wait thread, each member duplicates its part into two private channels
(header, data, point-to-point and bulk communicators), and those become lanes
of the rank's engine. Ranks that disagree about the set get the same error.
Members get the whole collective API on it (`LaneCollectives`: checked
headers, the small-message path, stall reports); ranks are numbered within
the set there, so a mismatch message names set ranks. Ranks outside get a
`Subset` whose every use says, by name, that they are not in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from ..base.errors import InvalidInputError
from ..engine.operation import Lane
from .collectives import LaneCollectives


class LaneMaker(Protocol):
    """The coordinator's plumbing that making and removing a set needs (`lowlevel`)."""

    async def make_lanes(self, what: str, channels: Callable[[], Sequence[Any] | None],
                         by_name: Sequence[bool], ranks: tuple[int, ...] = ()
                         ) -> list[Lane] | None: ...

    def remove_lane(self, lane: Lane) -> None: ...

    def on_lane(self, lane: Lane) -> LaneCollectives: ...


class SubsetHost(Protocol):
    """What making and removing a set needs of the coordinator."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def backend(self) -> Any: ...

    @property
    def lowlevel(self) -> LaneMaker: ...

    async def drain(self) -> None: ...


class Subset:
    """A fixed group of world ranks; `api` is its collective API on members."""

    def __init__(self, ranks: tuple[int, ...], world_rank: int, ident: int,
                 api: LaneCollectives | None, lane: Lane | None,
                 grad_lane: Lane | None = None) -> None:
        self.ranks, self.ident = ranks, ident
        self._world_rank, self._api, self.lane = world_rank, api, lane
        self.grad_lane = grad_lane  # a DistributedOptimizer's buckets (members only)
        self.removed = False

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This rank's number within the set; -1 outside it."""
        return self.ranks.index(self._world_rank) if self.included else -1

    @property
    def included(self) -> bool:
        return self._world_rank in self.ranks

    @property
    def api(self) -> LaneCollectives:
        """The collectives among the set's ranks (members only, until removed)."""
        if self.removed:
            raise InvalidInputError(f"process set {list(self.ranks)} was removed")
        if self._api is None:
            raise InvalidInputError(f"rank {self._world_rank} is not in process set "
                                    f"{list(self.ranks)}: only its members may call its "
                                    "collectives")
        return self._api

    def set_rank(self, world_rank: int) -> int:
        """A world rank (Horovod's `root_rank`) as a rank within the set."""
        if world_rank not in self.ranks:
            raise InvalidInputError(f"root rank {world_rank} is not in process set "
                                    f"{list(self.ranks)}")
        return self.ranks.index(world_rank)

    def __repr__(self) -> str:
        return f"<Subset #{self.ident} ranks={list(self.ranks)} rank={self.rank}>"


_ids = [0]  # the last set made: ids agree across ranks, sets are made in the same order


def normalise(ranks: Iterable[int], size: int) -> tuple[int, ...]:
    """Sorted distinct world ranks; refuse empty sets and ranks outside the world."""
    out = tuple(sorted({int(r) for r in ranks}))
    if not out or out[0] < 0 or out[-1] >= size:
        raise InvalidInputError(f"a process set needs ranks in 0..{size - 1}, got {list(out)}")
    return out


async def make_subset(coord: SubsetHost, ranks: Iterable[int]) -> Subset:
    """Every world rank calls this, in the same order (it splits a communicator)."""
    chosen = normalise(ranks, coord.size)
    split = getattr(coord.backend, "subchannels", None)
    if split is None:
        raise NotImplementedError(f"process sets need the MPI backend (this is "
                                  f"{coord.backend.name})")
    ident = _ids[0] + 1  # counted once made: a failed make leaves every rank's count
    names = (f"set{ident}", f"set{ident}.grad")
    lanes = await coord.lowlevel.make_lanes("process set", lambda: split(names, chosen),
                                            (True, False), ranks=chosen)
    _ids[0] = ident
    if lanes is None:
        return Subset(chosen, coord.rank, ident, None, None)
    lane, grad_lane = lanes
    return Subset(chosen, coord.rank, ident, coord.lowlevel.on_lane(lane), lane, grad_lane)


async def remove_subset(coord: SubsetHost, subset: Subset) -> None:
    """Members finish what is in flight, then free the set's channel; idempotent."""
    if subset.removed:
        return
    subset.removed = True
    if subset.lane is not None:
        await coord.drain()
        coord.lowlevel.remove_lane(subset.lane)
    if subset.grad_lane is not None:
        coord.lowlevel.remove_lane(subset.grad_lane)
