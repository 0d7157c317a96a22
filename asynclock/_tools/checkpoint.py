"""Consistent checkpoints that survive a SIGKILL of any rank at any moment.

Layout of `directory`::

    step-000000000120.<nonce>/rank-00000-of-00002.pt   (sharded: one file per rank)
    step-000000000120.<nonce>/state.pt                 (or rank 0's file alone)
    step-000000000120.<nonce>/MANIFEST.json            (written last: the set is complete)
    latest                                             (name of the newest complete set)

Save protocol (every rank calls `save`; file I/O runs in worker threads so
the event loop keeps serving other tasks):

1. agree on the step and a fresh directory name (one allgather on the sync
   lane; a step is never written into an existing directory, so a complete
   checkpoint is never modified in place);
2. each writer streams its state to a temp file while hashing it, fsyncs,
   renames it to its final name and fsyncs the directory;
3. an allgather of (file, size, sha256) is the barrier "every shard is
   durable"; a rank that failed contributes its error, and all ranks raise;
4. rank 0 writes MANIFEST.json (temp, fsync, rename, fsync dir): from now on
   the set is complete;
5. rank 0 moves `latest` the same way, then deletes old sets beyond `keep`
   (manifest first, so a half-deleted set is never taken for complete);
6. a broadcast from rank 0 tells every rank the save is done (or why not).

A kill before step 4 leaves a directory without a manifest: never loaded,
removed by a later save. A kill between 4 and 5 leaves `latest` one behind:
`find_latest` also scans for manifests, so the newest complete set wins.
Loading verifies sizes and sha256 digests, and falls back to the next
older complete set if a file is damaged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
import pickle
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import anyio.to_thread

from .._core.base.errors import AsynclockError

if TYPE_CHECKING:
    from .._core.runtime.coordinator import Coordinator

log = logging.getLogger("asynclock.checkpoint")

MANIFEST = "MANIFEST.json"
LATEST = "latest"
_SET = re.compile(r"^step-(\d{12})\.([0-9a-f]+)$")
_DAMAGED, _UNUSABLE = "damaged", "unusable"  # why a rank cannot load its part of a set


@dataclass(frozen=True, slots=True)
class _Refusal:
    """Why this rank cannot load its part of a set: `_DAMAGED` (an older set may serve)
    or `_UNUSABLE` (intact, but not for this job)."""

    kind: str
    why: str


class CheckpointError(AsynclockError, RuntimeError):
    """A save or load failed; raised on every rank with the same message."""


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    """A complete checkpoint set on disk."""

    path: Path
    step: int
    manifest: dict[str, Any]

    def file_for(self, rank: int) -> Path:
        """The file rank `rank` loads: its shard, or the single state file."""
        if self.manifest["sharded"]:
            return self.path / shard_name(rank, int(self.manifest["world_size"]))
        return self.path / "state.pt"


def shard_name(rank: int, size: int) -> str:
    return f"rank-{rank:05d}-of-{size:05d}.pt"


# -- durable file primitives (blocking: run in worker threads) -----------------------
def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Atomically move a durable temp file to its final name, durably."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


class _HashingWriter:
    """File wrapper that hashes and counts bytes as the serializer writes them."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.nbytes += view.nbytes
        return self._f.write(view)

    def flush(self) -> None:
        self._f.flush()


def write_durably(final: Path, dump: Callable[[Any], None]) -> dict[str, Any]:
    """temp file -> dump -> fsync -> rename -> fsync dir; returns size and digest."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        w = _HashingWriter(f)
        dump(w)
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, final)
    return {"bytes": w.nbytes, "sha256": w.sha.hexdigest()}


def _write_text(final: Path, text: str) -> None:
    write_durably(final, lambda w: w.write(text.encode()))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def remove_set(path: Path) -> None:
    """Delete a set: manifest first (durably), so it is never half-complete."""
    manifest = path / MANIFEST
    if manifest.exists():
        manifest.unlink()
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


# -- finding the newest complete set ---------------------------------------------------
def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest: dict[str, Any] = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest


def check_set(path: Path, verify: bool = True) -> CheckpointRef | None:
    """The set at `path` if its manifest exists and every file matches it."""
    manifest = _read_manifest(path)
    if manifest is None:
        return None
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file() or f.stat().st_size != meta["bytes"]:
            return None
        if verify and sha256_file(f) != meta["sha256"]:
            return None
    return CheckpointRef(path, int(manifest["step"]), manifest)


def _saves(directory: Path) -> list[tuple[int, int, int, Path]]:
    """(save sequence, step, mtime, path) of every set that has a manifest, the newest
    save first: by the sequence (`seq` in its manifest), so a run that starts its steps
    again in the same folder has its own sets counted newest; then by step."""
    found = []
    for p in Path(directory).glob("step-*"):
        m = _SET.match(p.name)
        if m and (p / MANIFEST).is_file():
            manifest = _read_manifest(p) or {}
            found.append((int(manifest.get("seq", 0)), int(m.group(1)), p.stat().st_mtime_ns, p))
    return sorted(found, reverse=True)


def complete_sets(directory: Path) -> list[Path]:
    """Set directories that have a manifest, the newest save first (`_saves`)."""
    return [p for *_, p in _saves(directory)]


def _next_seq(directory: Path) -> int:
    """One more than the highest save sequence of a complete set in `directory`."""
    saves = _saves(directory)
    return saves[0][0] + 1 if saves else 1


def find_latest(directory: Path | str, verify: bool = True) -> CheckpointRef | None:
    """The newest complete, intact checkpoint set, or None.

    `latest` is only a hint: a kill can leave it one set behind, and a set
    can be damaged later, so the scan over manifests decides. Blocking file I/O
    on this rank alone: no collective, no coordinator needed.

    Args:
        directory: the folder a `Checkpointer` saves into.
        verify: also compare each file's sha256 digest with its manifest (sizes are
            always compared); False reads only the manifests and file sizes.

    Returns:
        The set (`.path`, `.step`, `.manifest`), or None where no complete set is intact.
    """
    directory = Path(directory)
    for path in complete_sets(directory):
        ref = check_set(path, verify)
        if ref is not None:
            return ref
    return None


# -- serializers ---------------------------------------------------------------------
def _dumper(state: Any, serializer: str) -> Callable[[Any], None]:
    if serializer == "torch":
        import torch

        return lambda w: torch.save(state, w)
    if serializer == "pickle":
        return lambda w: pickle.dump(state, w, protocol=5)
    raise ValueError(f"unknown serializer {serializer!r}: use 'torch' or 'pickle'")


def _load_file(path: Path, serializer: str, map_location: Any, weights_only: bool) -> Any:
    if serializer == "torch":
        import torch

        return torch.load(path, map_location=map_location, weights_only=weights_only)
    with open(path, "rb") as f:
        return pickle.load(f)


def _step_number(step: Any) -> int | str:
    """The step as an int (anything with `__index__`: numpy and 0-d torch integers
    too), or its repr where it is no integer >= 0."""
    try:
        number = operator.index(step)
    except TypeError:
        return repr(step)
    return number if number >= 0 and not isinstance(step, bool) else repr(step)


class Checkpointer:
    """Collective save/load of consistent checkpoint sets in `directory`.

    Every rank makes one with the same arguments, and calls `save` and `load`
    in the same order; the collectives run on the coordinator's sync lane.

    Args:
        coord: the running coordinator.
        directory: folder of the checkpoint sets, shared by the ranks that write
            (created on the first save).
        keep: how many complete sets to keep; older ones are deleted after a save.
        sharded: False: rank 0 saves `state` (the other ranks' `state` is ignored) and
            every rank loads it. True: each rank saves and loads its own shard, and a
            load needs a job of the same size.
        serializer: `"torch"` (`torch.save`/`torch.load`) or `"pickle"`.

    Raises:
        ValueError: `keep` is below 1, or `serializer` is neither "torch" nor "pickle".
    """

    def __init__(self, coord: Coordinator, directory: Path | str, *, keep: int = 2,
                 sharded: bool = False, serializer: str = "torch") -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if serializer not in ("torch", "pickle"):  # here, where every rank makes one alike
            raise ValueError(f"unknown serializer {serializer!r}: use 'torch' or 'pickle'")
        self.coord = coord
        self.directory = Path(directory)
        self.keep = keep
        self.sharded = sharded
        self.serializer = serializer
        self._lane = coord.lowlevel.on_lane(coord.lowlevel.sync_lane)
        self.saved = self.loaded = 0

    @property
    def _writes(self) -> bool:
        return self.sharded or self.coord.rank == 0

    # -- save -----------------------------------------------------------------------
    async def save(self, step: int, state: Any, *, metadata: dict[str, Any] | None = None
                   ) -> Path:
        """Write `state` as checkpoint `step`; a collective, called on every rank.

        Args:
            step: the training step; every rank passes the same one.
            state: what to save (this rank's shard, or rank 0's whole state).
            metadata: JSON-serializable values stored in the manifest (rank 0's).

        Returns:
            The complete set's directory.

        Raises:
            CheckpointError: on every rank, where ranks pass different steps, a rank
                could not write its file, or rank 0 could not complete the set; the
                previous complete set stays.
        """
        with anyio.CancelScope(shield=True):  # a cancel waits: peers need every call
            path = await self._agree(step)
            mine = await self._write_mine(path, state)
            rows: list[Any] = await self._lane.allgather_object(mine, name="ckpt.written")
            failed = [f"rank {r}: {row}" for r, row in enumerate(rows) if isinstance(row, str)]
            if failed:
                raise CheckpointError(f"checkpoint step {step}: writing failed on " +
                                      "; ".join(failed) + " (the newest complete set before "
                                      "it stays)")
            outcome = None
            if self.coord.rank == 0:
                outcome = await self._complete(path, step, rows, metadata or {})
            outcome = await self._lane.broadcast_object(outcome, root=0, name="ckpt.done")
        if outcome is not None:
            raise CheckpointError(f"checkpoint step {step}: {outcome}")
        self.saved += 1
        return path

    async def _agree(self, step: Any) -> Path:
        """One allgather: same step everywhere, and rank 0's fresh nonce. A step that
        is no integer >= 0 is refused on every rank (this rank sends its repr)."""
        mine: int | str = _step_number(step)
        rows = await self._lane.allgather_object((mine, secrets.token_hex(6)),
                                                 name="ckpt.begin")
        bad = [f"rank {r}: {s}" for r, (s, _) in enumerate(rows) if isinstance(s, str)]
        if bad:
            raise CheckpointError("the checkpoint step must be an integer >= 0 on every "
                                  "rank; not on " + "; ".join(bad))
        steps = sorted({s for s, _ in rows})
        if len(steps) != 1:
            raise CheckpointError("ranks disagree on the checkpoint step: " +
                                  "; ".join(f"rank {r}: {s}" for r, (s, _) in enumerate(rows)))
        path = self.directory / f"step-{steps[0]:012d}.{rows[0][1]}"
        await anyio.to_thread.run_sync(lambda: path.mkdir(parents=True, exist_ok=True))
        return path

    async def _write_mine(self, path: Path, state: Any) -> dict[str, Any] | str | None:
        """This rank's file, durably; an error travels as text to every rank."""
        if not self._writes:
            return None
        name = shard_name(self.coord.rank, self.coord.size) if self.sharded else "state.pt"
        dump = _dumper(state, self.serializer)
        try:
            meta = await anyio.to_thread.run_sync(write_durably, path / name, dump)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return {"name": name, "rank": self.coord.rank, **meta}

    async def _complete(self, path: Path, step: int, rows: list[Any],
                        metadata: dict[str, Any]) -> str | None:
        """Rank 0: manifest, then `latest`, then garbage; None on success."""
        files = {row["name"]: {k: row[k] for k in ("bytes", "sha256", "rank")}
                 for row in rows if row is not None}
        manifest = {"format": 1, "step": step, "world_size": self.coord.size,
                    "sharded": self.sharded, "serializer": self.serializer,
                    "files": files, "metadata": metadata}
        try:
            await anyio.to_thread.run_sync(self._publish_set, path, manifest)
        except Exception as exc:
            return f"completing the set failed on rank 0: {type(exc).__name__}: {exc}"
        return None

    def _publish_set(self, path: Path, manifest: dict[str, Any]) -> None:
        manifest["seq"] = _next_seq(self.directory)
        _write_text(path / MANIFEST, json.dumps(manifest, indent=1))
        _write_text(self.directory / LATEST, path.name + "\n")
        self._collect(path)

    def _collect(self, newest: Path) -> None:
        """Drop complete sets beyond `keep` and partial sets left by crashed saves."""
        complete = complete_sets(self.directory)
        for old in complete[self.keep:]:
            remove_set(old)
        for p in self.directory.glob("step-*"):
            if p != newest and p not in complete[: self.keep] and not (p / MANIFEST).exists():
                shutil.rmtree(p, ignore_errors=True)
        for tmp in self.directory.glob(f".{LATEST}.tmp-*"):
            tmp.unlink(missing_ok=True)

    # -- load -----------------------------------------------------------------------
    async def load(self, *, map_location: Any = "cpu", weights_only: bool = True,
                   verify: bool = True) -> tuple[int, Any] | None:
        """Load the newest complete set; a collective, called on every rank.

        Rank 0 picks the set (manifest and sizes) and tells the others, so all
        ranks load the same step; each rank verifies its own file's digest.
        If any rank finds its file damaged, all ranks move on to the next
        older complete set together.

        Args:
            map_location: passed to `torch.load` (ignored by the pickle serializer).
            weights_only: passed to `torch.load`: True unpickles tensors and plain
                containers only.
            verify: compare this rank's file with its manifest's sha256 digest.

        Returns:
            `(step, state)` on every rank (this rank's shard where sharded), or None
            where no complete, intact set remains.

        Raises:
            CheckpointError: on every rank, where an intact set cannot be used here: a
                sharded set of another world size, or a file its serializer refuses
                (e.g. `weights_only=True` and a pickled object it does not allow). An
                older set is not taken instead: it would silently resume from further
                back.
        """
        with anyio.CancelScope(shield=True):  # a cancel waits: peers need every call
            loaded = await self._load(map_location, weights_only, verify)
        return loaded

    async def _load(self, map_location: Any, weights_only: bool, verify: bool
                    ) -> tuple[int, Any] | None:
        rejected: list[str] = []
        while True:
            chosen = await self._choose(rejected)
            if chosen is None:
                return None
            result = await self._read_mine(Path(chosen), map_location, weights_only, verify)
            errors = await self._lane.allgather_object(
                (result.kind, result.why) if isinstance(result, _Refusal) else None,
                name="ckpt.loaded")
            unusable = [f"rank {r}: {e[1]}" for r, e in enumerate(errors)
                        if e is not None and e[0] == _UNUSABLE]
            if unusable:
                raise CheckpointError(f"checkpoint {chosen} cannot be loaded: " +
                                      "; ".join(unusable))
            damaged = [f"rank {r}: {e[1]}" for r, e in enumerate(errors) if e is not None]
            if not damaged:
                self.loaded += 1
                return result  # type: ignore[return-value]
            log.warning("checkpoint %s rejected (%s); trying an older one", chosen,
                        "; ".join(damaged))
            rejected.append(chosen)

    async def _choose(self, rejected: list[str]) -> str | None:
        chosen = None
        if self.coord.rank == 0:
            chosen = await anyio.to_thread.run_sync(self._newest, rejected)
        result: str | None = await self._lane.broadcast_object(chosen, root=0,
                                                               name="ckpt.load")
        return result

    def _newest(self, rejected: list[str]) -> str | None:
        for path in complete_sets(self.directory):
            if str(path) not in rejected and check_set(path, verify=False) is not None:
                return str(path)
        return None

    async def _read_mine(self, path: Path, map_location: Any, weights_only: bool,
                         verify: bool) -> tuple[int, Any] | _Refusal:
        """This rank's part of the set, or why it cannot have it."""
        def read() -> tuple[int, Any] | _Refusal:
            ref = check_set(path, verify=False)
            if ref is None:
                return _Refusal(_DAMAGED, f"{path} is no longer a complete set")
            if ref.manifest["sharded"] and ref.manifest["world_size"] != self.coord.size:
                return _Refusal(_UNUSABLE, f"it has {ref.manifest['world_size']} shards, "
                                           f"this job has {self.coord.size} ranks")
            f = ref.file_for(self.coord.rank)
            digest = ref.manifest["files"][f.name]["sha256"]
            if verify and sha256_file(f) != digest:
                return _Refusal(_DAMAGED, f"{f.name} does not match its manifest digest")
            try:
                return ref.step, _load_file(f, ref.manifest["serializer"], map_location,
                                            weights_only)
            except Exception as exc:
                intact = verify or sha256_file(f) == digest
                return _Refusal(_UNUSABLE if intact else _DAMAGED,
                                f"{type(exc).__name__}: {exc}")
        try:
            return await anyio.to_thread.run_sync(read)
        except Exception as exc:
            return _Refusal(_DAMAGED, f"{type(exc).__name__}: {exc}")
