"""Agree on settings that change collective order before any rank uses them.

Some knobs decide *which* communicator or how many messages an operation
uses (e.g. the bulk threshold of the progress engine). If ranks disagree
(different environment variables per node), their communication patterns
diverge and the job hangs. So at start-up every rank gathers every rank's
fingerprint and all raise the same error naming the differing ranks.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from .collective_ops import AllgatherObjectOp
from .errors import CollectiveTimeout, MismatchError
from .header import Call
from .ops import Kind

if TYPE_CHECKING:
    from .runtime import Coordinator


def fingerprint(coord: Coordinator) -> dict[str, Any]:
    """What must be identical on every rank."""
    from . import __version__

    policy = dataclasses.asdict(coord.engine.policy)
    return {"asynclock": __version__, "backend": coord.backend.name,
            "thread_min_bytes": policy["thread_min_bytes"], "size": coord.size}


def agree_config(coord: Coordinator, timeout: float = 120.0) -> None:
    """Blocking start-up check (runs before the engine's poller exists)."""
    lane = coord._lane
    mine = fingerprint(coord)
    import pickle

    blob = pickle.dumps(mine)
    op = AllgatherObjectOp(lane, Call(Kind.ALLGATHER_OBJECT, lane.next_seq(), name="config",
                                      nbytes=len(blob)), blob)
    engine = coord.engine
    engine.submit(op)
    deadline = time.monotonic() + timeout
    while not op.done:
        engine.poll_all()
        if time.monotonic() > deadline:
            raise CollectiveTimeout(f"ranks did not all join asynclock start-up within {timeout} s")
        time.sleep(0.0005)
    _compare(op.outcome())


def _compare(prints: list[dict[str, Any]]) -> None:
    """Raise on every rank, naming the ranks whose settings differ from rank 0's."""
    differ = {r: p for r, p in enumerate(prints) if p != prints[0]}
    if differ:
        detail = "; ".join(f"rank {r}: {p}" for r, p in differ.items())
        raise MismatchError(f"asynclock settings differ across ranks (rank 0: {prints[0]}); "
                            f"{detail}. Set the same ASYNCLOCK_* environment on every rank.")
