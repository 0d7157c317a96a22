"""The package's structure, held by tools: declared layers (`.importlinter`), no import
cycles, and a public face that is importable and documented."""

from __future__ import annotations

import importlib
import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ("asynclock", "asynclock.torch", "asynclock.cuda")


def test_layers_hold() -> None:
    """No module imports a layer above its own (import-linter's contracts)."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (launch/setup.sh installs it)")
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively (the graph has ~110 modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(component)
    return found


def test_no_import_cycles() -> None:
    """Every import, inside functions and under TYPE_CHECKING too, points one way."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter")
    graph = grimp.build_graph("asynclock")
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = [sorted(c) for c in _strongly_connected(edges) if len(c) > 1]
    assert not cycles, cycles


def test_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [sorted(c) for c in _strongly_connected(edges) if len(c) > 1] == [["a", "b", "c"]]


def _documented(module: str, name: str, obj: object, text: str) -> bool:
    """A class or function has a docstring of its own; a value is named in the
    module's docstring or in a docstring of the face's functions."""
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return bool(inspect.getdoc(obj)) and inspect.getdoc(obj) != inspect.getdoc(type(obj))
    return f"`{name}`" in text or f"{name}:" in text or f" {name} " in text


@pytest.mark.parametrize("module", PUBLIC)
def test_public_names_are_importable_and_documented(module: str) -> None:
    mod = importlib.import_module(module)
    names = list(getattr(mod, "__all__", ()))
    assert names, f"{module} has no __all__"
    assert len(names) == len(set(names)), f"{module}.__all__ repeats a name"
    text = (mod.__doc__ or "") + (ROOT / "docs" / "reference").joinpath(
        f"{module.split('.')[-1] if module != 'asynclock' else 'asynclock'}.md").read_text()
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names what it does not have: {missing}"
    undocumented = [n for n in names if not _documented(module, n, getattr(mod, n), text)]
    assert not undocumented, f"{module}: no docstring or mention for {undocumented}"


@pytest.mark.parametrize("module", PUBLIC)
def test_public_face_is_small(module: str) -> None:
    """Internals stay private: a public package's submodules are private, or a face."""
    mod = importlib.import_module(module)
    folder = Path(mod.__file__ or "").parent
    public = sorted(p.stem for p in folder.glob("*.py")
                    if not p.stem.startswith("_")) + sorted(
        p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    allowed = {"asynclock": ["hvdrun", "jobwatch", "launch", "metrics", "plot", "timeline",
                             "cuda", "torch"],
               "asynclock.torch": [], "asynclock.cuda": []}[module]
    assert sorted(public) == sorted(allowed), public


# The coordinator's user face: collectives, cross-rank primitives, identity, process sets,
# the train step and the engine's life. Plumbing lives under `coord.lowlevel`; a new public
# name on either is a decision, made here.
COORDINATOR_FACE = (
    "adasum", "allgather", "allgather_async", "allgather_object", "allgather_object_async",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "barrier_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_object_async",
    "reduce_scatter", "reduce_scatter_async", "group_size",
    "condition", "consistency_point", "event", "lock", "semaphore", "sequential",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "backend",
    "process_set", "remove_process_set", "join", "train_step", "statistics",
    "running", "drain", "shutdown", "lowlevel",
)
LOWLEVEL = (
    "engine", "user_lane", "grad_lane", "more_grad_lanes", "sync_lane", "model_lane", "sync",
    "watchdog", "add_lane", "make_lanes", "remove_lane", "on_lane", "small_path_statistics",
    "run_sync", "run_sync_then_start", "call_blocking", "abandon",
)


def _public(obj: object) -> list[str]:
    return sorted(n for n in dir(obj) if not n.startswith("_"))


def test_coordinator_face() -> None:
    """A coordinator's public attributes, its instance's included, are exactly the face."""
    import asynclock
    from asynclock._core.transports.local import LocalBackend

    coord = asynclock.Coordinator(LocalBackend())
    try:
        assert _public(coord) == sorted(COORDINATOR_FACE)
        assert _public(coord.lowlevel) == sorted(LOWLEVEL)
        undocumented = [n for n in COORDINATOR_FACE
                        if not inspect.getdoc(getattr(type(coord), n))]
        assert not undocumented, f"Coordinator: no docstring for {undocumented}"
    finally:
        coord.shutdown()
