"""Horovod's process sets for `import asynclock.torch as hvd`.

`hvd.ProcessSet([0, 2])` names ranks; `hvd.init(process_sets=[...])` or
`hvd.add_process_set(...)` makes it (every rank calls, in the same order),
and the tensor and object collectives take `process_set=`. As in Horovod,
`root_rank` stays a world rank and the global set is id 0. The work is done
by `api.process_sets` (a channel of the set's own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._core.api.process_sets import Subset, normalise
from ..._core.runtime import coordinator as runtime


class ProcessSet:
    """A set of world ranks that run collectives together (Horovod's class).

    It takes part in collectives once `add_process_set` (or `hvd.init(process_sets=)`)
    made it on every rank.

    Args:
        ranks_or_comm: the world ranks (any order; kept sorted), or an mpi4py
            communicator whose members it takes.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.process_set_id: int | None = None
        self.ranks: list[int] | None = sorted(int(r) for r in _ranks_of(ranks_or_comm))
        self.subset: Subset | None = None

    def size(self) -> int | None:
        """The number of ranks in the set.

        Returns:
            The count, or None once the set is removed.
        """
        return None if self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set.

        Returns:
            The rank, -1 outside the set, or None before the set is added.
        """
        return None if self.subset is None else self.subset.rank

    def included(self) -> bool | None:
        """Whether this process belongs to the set.

        Returns:
            True or False, or None before the set is added.
        """
        return None if self.subset is None else self.subset.included

    def invalidate(self) -> None:
        """Forget id, ranks and channel, as `remove_process_set` does."""
        self.process_set_id, self.ranks, self.subset = None, None, None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


def _ranks_of(ranks_or_comm: Any) -> list[int]:
    """A rank list, or an mpi4py communicator's members as world ranks."""
    if hasattr(ranks_or_comm, "Get_group"):
        from mpi4py import MPI

        group = ranks_or_comm.Get_group()
        world = MPI.COMM_WORLD.Get_group()
        return [int(r) for r in group.Translate_ranks(list(range(group.Get_size())), world)]
    return [int(r) for r in ranks_or_comm]


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_by_id: dict[int, ProcessSet] = {0: global_process_set}


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Make a set on every rank (a collective: all ranks, in the same order).

    Args:
        process_set: a `ProcessSet`, or the world ranks of a new one.

    Returns:
        The `ProcessSet`, with its id and channel.

    Raises:
        InvalidInputError: the set is empty, or a rank is outside the world.
        NotImplementedError: the job does not run on asynclock's MPI transport.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    coord = runtime.coordinator()
    ranks = normalise(ps.ranks or [], coord.size)
    subset = coord.lowlevel.run_sync(coord.process_set, ranks)
    ps.ranks, ps.subset, ps.process_set_id = list(ranks), subset, subset.ident
    _by_id[subset.ident] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Free a set's channel on every rank (a collective).

    Args:
        process_set: an added set; it forgets its id, ranks and channel.

    Returns:
        True; False for the global set or one that is not added.
    """
    ident = process_set.process_set_id
    if not ident or ident not in _by_id or process_set.subset is None:
        return False
    coord = runtime.coordinator()
    coord.lowlevel.run_sync(coord.remove_process_set, process_set.subset)
    del _by_id[ident]
    process_set.invalidate()
    return True


def process_set_by_id(process_set_id: int) -> ProcessSet:
    """The added `ProcessSet` with this id.

    Args:
        process_set_id: the set's id (0 is `global_process_set`).

    Returns:
        The set.

    Raises:
        ValueError: no added set has this id, as in Horovod.
    """
    if process_set_id not in _by_id:
        raise ValueError(f"No known process set with id {process_set_id}")
    return _by_id[process_set_id]


def process_sets() -> list[ProcessSet]:
    """The process sets added and not removed.

    Returns:
        The sets by id (`global_process_set`, id 0, first).
    """
    return [_by_id[i] for i in sorted(_by_id)]


def setup_at_init(process_sets_arg: Any) -> None:
    """`hvd.init(process_sets=...)`: the global set's ranks, then each listed set."""
    global_process_set.ranks = list(range(runtime.coordinator().size))
    if process_sets_arg in (None, "dynamic"):
        return
    for ps in process_sets_arg:
        add_process_set(ps)


def forget_process_sets() -> None:
    """An elastic reset changed the world: every set but the global one is gone
    (their ranks and channels belonged to the old world); add them again."""
    for ident in [i for i in _by_id if i != 0]:
        _by_id.pop(ident).invalidate()
    global_process_set.ranks = list(range(runtime.coordinator().size))


def api_of(process_set: ProcessSet | None) -> Any:
    """The collective API a call with `process_set=` runs on."""
    coord = runtime.coordinator()
    if process_set is None or process_set.process_set_id == 0:
        return coord
    if process_set.subset is None:
        raise ValueError(f"{process_set} is not added: call hvd.add_process_set() on every "
                         "rank first")
    return process_set.subset.api


def root_of(process_set: ProcessSet | None, root_rank: int) -> int:
    """Horovod's `root_rank` is a world rank; the set's channel numbers its members."""
    if process_set is None or process_set.process_set_id == 0 or process_set.subset is None:
        return root_rank
    return process_set.subset.set_rank(root_rank)
