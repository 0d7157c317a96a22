"""One error hierarchy for asynclock.

Errors that concern several ranks (mismatches, failures, stalls) carry the
same message on every rank, so logs from different ranks can be matched up.
"""

from __future__ import annotations


class AsynclockError(Exception):
    """Base class of every error asynclock raises."""


class NotInitializedError(AsynclockError, RuntimeError):
    """An API was used before `asynclock.init()` / `asynclock.start()`."""


class ShutdownError(AsynclockError, RuntimeError):
    """An API was used after the coordinator was shut down."""


class InvalidInputError(AsynclockError, ValueError):
    """A tensor or argument cannot be communicated (layout, dtype, device)."""


class MismatchError(AsynclockError, RuntimeError):
    """Ranks called a collective with different kinds, shapes, dtypes or ops.

    Raised on every rank with the same message naming each rank's call.
    """


class JoinedError(AsynclockError, RuntimeError):
    """A collective that joined ranks cannot stand in for (only allreduce and
    barrier can), raised on every rank; the joined ranks keep serving."""


class RemoteInputError(AsynclockError, RuntimeError):
    """Another rank rejected its own input for the collective we share."""


class BackendError(AsynclockError, RuntimeError):
    """The transport (MPI or Horovod) reported an error."""


class CollectiveTimeout(AsynclockError, TimeoutError):
    """A wait passed its deadline; the message names the operation."""


class RankFailedError(AsynclockError, RuntimeError):
    """Another rank died or became unreachable."""


class StallError(AsynclockError, RuntimeError):
    """An operation waited past the stall shutdown threshold."""


class UnmatchedError(MismatchError):
    """Collectives that some ranks issued and the others never did (e.g. a name
    that differs by rank): every rank waited on such calls past the stray timeout,
    or the job shut down. The message names every rank's unmatched calls."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by an elastic state's `commit()` / `check_host_updates()` on every rank
    at once, when Horovod's elastic driver reported hosts added or removed: the job
    re-forms at this commit point. `skip_sync`: hosts were only removed, so every
    rank of the new world already holds the committed state.

    Not an `AsynclockError`: nothing failed, and code that catches those must not
    swallow a re-formation.

    Args:
        skip_sync: hosts were only removed, so the state need not be synchronized
            after the reset.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts were added or removed: the job re-forms at this commit")
        self.skip_sync = skip_sync
