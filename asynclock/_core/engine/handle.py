"""Handles returned by the `*_async` collectives."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from .operation import Operation
from .progress import Engine


class Handle:
    """An in-flight collective: `await h` for the result, `h.done()` to peek.

    Dropping or cancelling the awaiting task never withdraws the collective
    (other ranks rely on it); the engine completes it in the background.
    Returned by the `*_async` collectives; never made directly.

    Args:
        engine: the progress engine that completes the operation.
        op: the operation in flight.
    """

    __slots__ = ("_engine", "_op")

    def __init__(self, engine: Engine, op: Operation) -> None:
        self._engine = engine
        self._op = op

    def __await__(self) -> Generator[Any, None, Any]:
        if self._op.done:  # fast path: no scheduler round trip
            return self._op.outcome()
        return (yield from self._engine.wait(self._op).__await__())

    def done(self) -> bool:
        """Whether the collective completed on this rank; never waits.

        Returns:
            True once the result (or error) is available on this rank.
        """
        return self._op.done

    def result(self) -> Any:
        """The result of a completed collective, without waiting.

        Returns:
            What `await handle` returns.

        Raises:
            RuntimeError: the collective has not completed yet.
            AsynclockError: the collective's own error (MismatchError,
                RankFailedError, ...).
        """
        if not self._op.done:
            raise RuntimeError(f"{self._op.describe()} has not completed yet")
        return self._op.outcome()

    @property
    def name(self) -> str:
        """The collective's description: kind, name and sequence number."""
        return self._op.describe()

    def __repr__(self) -> str:
        return f"<Handle {self._op.describe()} {'done' if self.done() else 'in flight'}>"
