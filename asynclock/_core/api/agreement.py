"""Agree on settings that change collective order before any rank uses them.

Some knobs decide *which* communicator or how many messages an operation
uses (e.g. the bulk threshold of the progress engine). If ranks disagree
(different environment variables per node), their communication patterns
diverge and the job hangs. So at start-up every rank gathers every rank's
fingerprint and all raise the same error naming the differing ranks.
"""

from __future__ import annotations

from typing import Any

from ..base import settings
from ..base.backoff import Backoff, poll_until
from ..base.errors import CollectiveTimeout, MismatchError
from ..base.header import Call
from ..base.ops import Kind
from ..base.version import __version__
from ..engine.collective_ops import AllgatherObjectOp
from ..engine.operation import Lane
from ..engine.progress import Engine

STARTUP_POLL_S = 0.0005  # no poller runs yet: the start-up round is tested this often


def fingerprint(engine: Engine, backend: str, size: int) -> dict[str, Any]:
    """What must be identical on every rank."""
    return {"asynclock": __version__, "backend": backend, "size": size,
            "thread_min_bytes": engine.policy.thread_min_bytes, **settings.agreed()}


def agree_config(engine: Engine, lane: Lane, backend: str, timeout: float = 120.0) -> None:
    """Blocking start-up check on `lane` (runs before the engine's poller exists)."""
    mine = fingerprint(engine, backend, lane.size)
    import pickle

    blob = pickle.dumps(mine)
    op = AllgatherObjectOp(lane, Call(Kind.ALLGATHER_OBJECT, lane.next_seq(), name="config",
                                      nbytes=len(blob)), blob)
    engine.submit(op)

    def joined() -> bool:
        if op.done:
            return True
        engine.poll_all()
        return False

    if not poll_until(joined, Backoff.every(STARTUP_POLL_S), timeout):
        raise CollectiveTimeout(f"ranks did not all join asynclock start-up within {timeout} s")
    _compare(op.outcome())


def _compare(prints: list[dict[str, Any]]) -> None:
    """Raise on every rank, naming the ranks whose settings differ from rank 0's."""
    differ = {r: p for r, p in enumerate(prints) if p != prints[0]}
    if differ:
        detail = "; ".join(f"rank {r}: {p}" for r, p in differ.items())
        raise MismatchError(f"asynclock settings differ across ranks (rank 0: {prints[0]}); "
                            f"{detail}. Set the same ASYNCLOCK_* environment on every rank.")
