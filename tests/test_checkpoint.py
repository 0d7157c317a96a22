"""Consistent checkpoints: torch round trips on real ranks, SIGKILL trials at
random times and at every step of the save protocol, and the on-disk rules
(partial sets never loaded, stale `latest`, damaged files, retention)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from mpijob import PROGRAMS, assert_all_ok, run_job

import asynclock
from asynclock._tools.checkpoint import (
    LATEST,
    MANIFEST,
    Checkpointer,
    CheckpointRef,
    complete_sets,
    find_latest,
)

sys.path.insert(0, str(PROGRAMS))
from ckpt_common import N, check_state  # noqa: E402

# -- real ranks -------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize(("nranks", "loop"), [(2, "asyncio"), (3, "trio")])
def test_torch_roundtrip(nranks: int, loop: str, tmp_path: Path) -> None:
    """Sharded and rank-0 sets, keep, fallback past a damaged shard, and errors
    (step disagreement, one rank's failed write) raised on every rank."""
    args = (["--trio"] if loop == "trio" else []) + [str(tmp_path)]
    job = run_job("ckpt_roundtrip.py", nranks, *args, timeout=180)
    assert_all_ok(job, nranks)
    for label in ("sharded", "rank0", "damaged_fallback", "errors", "restarted_steps",
                  "unusable_raises", "cancel_and_bad_step"):
        assert job.ok_lines(label) == set(range(nranks)), f"{label}\n{job.explain()}"


def _resumed(output: str) -> set[int]:
    return {int(m) for m in re.findall(r"^RANK \d+ OK resumed (-?\d+)", output, re.M)}


def _verify(ref: CheckpointRef) -> None:
    """Load every file of the set in this process and check its content."""
    for name, meta in ref.manifest["files"].items():
        state = _load(ref.path / name, ref.manifest["serializer"])
        check_state(state, ref.step, meta["rank"])


def _load(path: Path, serializer: str) -> Any:
    if serializer == "torch":
        import torch

        return torch.load(path, weights_only=False)
    import pickle

    return pickle.loads(path.read_bytes())


def _trial(d: Path, victim: int, spec: str, serializer: str, sharded: bool,
           newest: int) -> int:
    """One job killed by `spec`; returns the newest complete step afterwards."""
    args = ["--victim", str(victim), "--kill", spec, "--serializer", serializer]
    job = run_job("ckpt_kill.py", 2, *args, *(["--sharded"] if sharded else []), str(d),
                  timeout=60)
    where = f"trial {spec} victim {victim}\n{job.explain()}"
    assert job.returncode != 0 and not job.ok_lines("finished"), "not killed: " + where
    assert _resumed(job.output) == {newest}, "resumed elsewhere: " + where
    ref = find_latest(d / "ckpt")
    if ref is None:
        assert newest == -1, "lost the previous checkpoint: " + where
        return -1
    assert ref.step >= newest, where
    _verify(ref)
    return ref.step


PHASES = [  # (victim, kill spec, sharded): every step of the protocol on each writer
    (0, "write:2", True), (0, "publish:1", True), (0, "fsync_dir:1", True),
    (0, "publish:2", True), (0, "fsync_dir:2", True), (0, "publish:3", True),
    (0, "rmtree:1", True), (0, "write:2", False), (1, "write:3", True),
    (1, "publish:2", True),
]


@pytest.mark.mpi
def test_sigkill_any_rank_any_moment(tmp_path: Path) -> None:
    """14 jobs SIGKILLed mid-save (4 at random times, 10 at chosen protocol
    steps): the newest complete set always loads and verifies, never a partial
    one, and the next job resumes exactly from it (60 more random times with --long)."""
    trials = [(seed % 2, f"time:{seed}", seed % 3 != 0) for seed in range(4)] + PHASES
    newest = -1
    for victim, spec, sharded in trials:
        newest = _trial(tmp_path, victim, spec, "pickle", sharded, newest)
    assert newest >= 3, f"too few saves completed in 14 trials: {newest}"


@pytest.mark.mpi
def test_sigkill_torch_files(tmp_path: Path) -> None:
    """The same with torch.save files: killed before step 1's manifest, step 0
    loads (one trial: importing torch is slow; the protocol is format-blind)."""
    assert _trial(tmp_path, 0, "publish:5", "torch", True, -1) == 0


@pytest.mark.slow
@pytest.mark.mpi
def test_sigkill_long(tmp_path: Path) -> None:
    newest = -1
    for seed in range(100, 160):
        newest = _trial(tmp_path, seed % 2, f"time:{seed}", "pickle", seed % 2 == 0, newest)


# -- one rank, in process (local backend) ---------------------------------------------------
def _save_steps(d: Path, steps: list[int], keep: int = 2, **kw: Any) -> None:
    async def main() -> None:
        async with asynclock.start(backend="local") as c:
            ck = Checkpointer(c, d, keep=keep, serializer="pickle", **kw)
            for s in steps:
                await ck.save(s, {"step": s, "rank": 0, "w": _w(s)})
    anyio.run(main)


def _w(step: int) -> Any:
    import numpy as np

    return np.arange(N, dtype=np.int64) * (step + 1)


def _load_local(d: Path) -> tuple[int, Any] | None:
    async def main() -> tuple[int, Any] | None:
        async with asynclock.start(backend="local") as c:
            return await Checkpointer(c, d, serializer="pickle").load(weights_only=False)
    return anyio.run(main)


def test_partial_set_is_never_loaded(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2])
    partial = tmp_path / "step-000000000009.abcdef"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"half a file")
    ref = find_latest(tmp_path)
    assert ref is not None and ref.step == 2
    got = _load_local(tmp_path)
    assert got is not None and got[0] == 2
    check_state(got[1], 2, 0)
    _save_steps(tmp_path, [3])  # the next save removes the leftover
    assert not partial.exists()


def test_stale_latest_pointer_is_only_a_hint(tmp_path: Path) -> None:
    """A kill between the manifest and the `latest` rename leaves it behind."""
    _save_steps(tmp_path, [1, 2])
    sets = complete_sets(tmp_path)
    (tmp_path / LATEST).write_text(sets[-1].name + "\n")
    ref = find_latest(tmp_path)
    assert ref is not None and ref.step == 2


def test_damaged_newest_falls_back(tmp_path: Path) -> None:
    _save_steps(tmp_path, [4, 5])
    newest = complete_sets(tmp_path)[0] / "state.pt"
    raw = bytearray(newest.read_bytes())
    raw[-3] ^= 1
    newest.write_bytes(bytes(raw))
    ref = find_latest(tmp_path)
    assert ref is not None and ref.step == 4
    got = _load_local(tmp_path)
    assert got is not None and got[0] == 4
    assert find_latest(tmp_path, verify=False) is not None  # sizes alone cannot tell


def test_retention_and_no_temp_files(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2, 3, 4], keep=3)
    assert [int(p.name[5:17]) for p in complete_sets(tmp_path)] == [4, 3, 2]
    assert not list(tmp_path.rglob(".*tmp*"))
    assert all((p / MANIFEST).is_file() for p in tmp_path.glob("step-*"))
    assert (tmp_path / LATEST).read_text().strip() == complete_sets(tmp_path)[0].name


def test_unknown_serializer_is_refused_when_made() -> None:
    """Every rank makes its checkpointer alike, so a bad serializer fails on every rank
    there, not at the first save on the ranks that write while the others wait."""
    with pytest.raises(ValueError, match="serializer 'json'"):
        Checkpointer(None, "unused", serializer="json")  # type: ignore[arg-type]


def test_empty_directory_loads_none(tmp_path: Path) -> None:
    assert find_latest(tmp_path) is None
    assert _load_local(tmp_path / "missing") is None
