"""The node's shared window (`transports.shared_window`): the one primitive under the
user allreduce's node window and the gradient engine's shared-memory rounds. Its
contract in real jobs on both MPIs (programs/shared_window.py), and its slice
ownership, which both reducers take."""

from __future__ import annotations

import pytest
from mpijob import MPI_KIND, OTHER_KINDS, assert_labels, run_job

from asynclock._core.transports.shared_window import (
    BELL_OFFSET,
    COUNTERS,
    CTL_BYTES,
    SharedWindow,
    owned_slice,
)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", [MPI_KIND, *OTHER_KINDS])
@pytest.mark.parametrize("nranks", [2, 3])
def test_window_contract_in_a_real_job(kind: str, nranks: int) -> None:
    job = run_job("shared_window.py", nranks, timeout=120, kind=kind)
    assert_labels(job, nranks, "zeroed", "handoff", "bells", "abort")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_slices_cover_the_items_once_in_rank_order(n: int) -> None:
    for items in range(0, 3 * n + 2):
        slices = [owned_slice(items, r, n) for r in range(n)]
        assert slices[0][0] == 0 and slices[-1][1] == items
        assert all(a[1] == b[0] for a, b in zip(slices, slices[1:], strict=False))
        sizes = [hi - lo for lo, hi in slices]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_control_block_layout() -> None:
    """Counters, then the bell on a cache line of its own, then the region on a page."""
    memory = [bytearray(CTL_BYTES + 64) for _ in range(2)]
    win = SharedWindow(1, memory, 64, lambda: None)
    assert COUNTERS * 8 <= BELL_OFFSET and BELL_OFFSET % 64 == 0 and CTL_BYTES % 4096 == 0
    win.publish(COUNTERS - 1, 5)
    assert win.peek(COUNTERS - 1) == [0, 5] and win.least(COUNTERS - 1) == 0
    assert win.bells[0][0] != 0 and win.bells[1][0] == 0  # the peer's bell was rung
    win.regions[1][:] = 7
    assert bytes(memory[1][CTL_BYTES:]) == b"\x07" * 64 and not any(memory[0][CTL_BYTES:])
