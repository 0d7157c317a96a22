"""The node's shared window (`transports.shared_window`): the one primitive under the
user allreduce's node window and the gradient engine's shared-memory rounds. Its
contract in real jobs on both MPIs (programs/shared_window.py), and its slice
ownership, which both reducers take."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
from mpijob import MPI_KIND, OTHER_KINDS, assert_labels, run_job

from asynclock._core.base import futex
from asynclock._core.transports.node_segment import create_file, free_bytes, map_file
from asynclock._core.transports.shared_window import (
    BELL_OFFSET,
    COUNTERS,
    CTL_BYTES,
    SLEEPERS_OFFSET,
    SharedWindow,
    fence,
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
    """Counters, then the bell and the sleepers' count on cache lines of their own, then
    the region on a page."""
    memory = [bytearray(CTL_BYTES + 64) for _ in range(2)]
    win = SharedWindow(1, memory, 64, lambda: None)
    assert COUNTERS * 8 <= BELL_OFFSET and BELL_OFFSET % 64 == 0 and CTL_BYTES % 4096 == 0
    assert SLEEPERS_OFFSET >= BELL_OFFSET + 64 and SLEEPERS_OFFSET % 64 == 0
    win.publish(COUNTERS - 1, 5)
    assert win.peek(COUNTERS - 1) == [0, 5] and win.least(COUNTERS - 1) == 0
    assert win.bells[0][0] != 0 and win.bells[1][0] == 0  # the peer's bell was rung
    win.regions[1][:] = 7
    assert bytes(memory[1][CTL_BYTES:]) == b"\x07" * 64 and not any(memory[0][CTL_BYTES:])


def _in_futex_wait(thread: threading.Thread) -> bool:
    """The thread is blocked in the futex system call (Linux x86-64: number 202)."""
    try:
        return Path(f"/proc/self/task/{thread.native_id}/syscall").read_text().startswith("202 ")
    except OSError:
        return False


@pytest.mark.skipif(not (futex.available and os.uname().machine == "x86_64"
                         and Path("/proc/self/task").is_dir()),
                    reason="needs Linux x86-64 futexes and /proc")
def test_a_ring_wakes_only_where_a_thread_sleeps_on_the_bell(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A ring makes the futex wake only where the bell's owner has a thread asleep on
    it, and that thread, blocked in the futex before the ring, wakes: one sleeping far
    longer than the test would end by the ring alone."""
    memory = [bytearray(CTL_BYTES + 64) for _ in range(2)]
    wins = [SharedWindow(r, memory, 64, fence) for r in range(2)]
    wakes: list[int] = []
    real_wake = futex.wake
    monkeypatch.setattr(futex, "wake", lambda address: (wakes.append(address),
                                                        real_wake(address))[1])
    wins[0].publish(1, 1)  # nobody asleep on rank 1's bell: no system call
    assert wakes == [] and int(wins[1].sleepers[1][0]) == 0
    bell = wins[1].bell()
    thread = threading.Thread(target=wins[1].sleep, args=(bell, 60.0), daemon=True)
    thread.start()
    while not _in_futex_wait(thread):  # asleep in the kernel, on the bell as read
        assert thread.is_alive()
    assert int(wins[1].sleepers[1][0]) == 1
    wins[0].publish(1, 2)
    thread.join(20)
    assert not thread.is_alive(), "a ring left a thread asleep on the bell"
    assert wakes == [wins[0].bell_addresses[1]] and int(wins[1].sleepers[1][0]) == 0


def test_a_window_over_a_shared_file_hands_data_and_wakes_across_mappings() -> None:
    """Without an MPI world the window is one /dev/shm file every rank maps: two
    mappings of it (as two ranks have) see each other's regions and counters, and a
    ring on one wakes a sleeper on the other (a process-shared futex keys on the file,
    not the address). The file is gone once both mapped it."""
    region = 4096
    nbytes = 2 * (CTL_BYTES + region)
    path = create_file(nbytes, "test")
    assert path is not None
    try:
        mappings = [map_file(path, nbytes) for _ in range(2)]
    finally:
        os.unlink(path)
    assert all(m is not None for m in mappings)
    wins = [SharedWindow.over_mapping(r, 2, m, region) for r, m in enumerate(mappings)]
    assert wins[0].regions[0].ctypes.data != wins[1].regions[0].ctypes.data
    seen: list[int] = []

    def reader() -> None:
        assert wins[1].wait(1, 1, "test", limit_s=30.0)
        seen.append(int(wins[1].regions[0][region - 1]))

    # rank 1 has published its counter: only rank 0's is missing
    wins[1].publish(1, 1)
    thread = threading.Thread(target=reader)
    thread.start()
    wins[0].regions[0][:] = 9
    wins[0].publish(1, 1)
    thread.join(30)
    assert not thread.is_alive() and seen == [9]
    assert wins[0].least(1) == 1 and wins[1].peek(1) == [1, 1]
    with pytest.raises(ValueError, match="holds no 3 slots"):
        SharedWindow.over_mapping(0, 3, mappings[0], region)
    for w in wins:
        w.free()


def test_a_file_that_does_not_fit_in_shared_memory_is_refused_when_made(
        tmp_path: Path) -> None:
    """tmpfs takes any truncated size and raises SIGBUS at the first page it has no room
    for; the file's pages are allocated when it is made, so it is refused there (None,
    nothing left behind) and the ranks keep their buckets on the transport."""
    small = tmp_path / "shm"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                             capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        assert create_file(4 << 20, "test", str(small)) is None
        assert not list(small.iterdir())
        fits = create_file(256 << 10, "test", str(small))
        assert fits is not None and os.path.getsize(fits) == 256 << 10
        assert free_bytes(str(small)) <= (1 << 20) - (256 << 10)
    finally:
        subprocess.run(["umount", str(small)], check=False)
