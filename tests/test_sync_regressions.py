"""In-process regressions for the sync primitives (world size 1, local backend)."""

from __future__ import annotations

import anyio
import pytest

import asynclock


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancel_at_fast_path_checkpoint_releases_permit(backend: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A task cancelled at the fairness checkpoint right after a local take must
    not keep the permit (found by the cancellation torture test)."""
    monkeypatch.setenv("ASYNCLOCK_WATCHDOG", "0")

    async def main() -> None:
        async with asynclock.start(backend="local") as c:
            lock = c.lock("regression")
            for _ in range(50):
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    async with lock:
                        await anyio.sleep(0)
            await lock.acquire()
            assert lock.locked()
            lock.release()
            assert not lock.locked()

    anyio.run(main, backend=backend)
