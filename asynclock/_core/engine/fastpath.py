"""The C twin of the compact header round (`_fastpath.c`; see `engine.header_round`):
build it, find it, load it.

One build per MPI library (MPICH and Open MPI differ in ABI), named by a
checksum of `MPI.Get_library_version()` and compiled with that MPI's own
wrapper (`mpicc`), so it links the libmpi mpi4py loads. Setup builds it
(`mpi/build_fastpath.py` for every MPI present); where no compiler or
headers exist the pure Python path runs, with the same bytes on the wire.
`ASYNCLOCK_FASTPATH=0` turns it off (tests run both ways).

The C rounds run on MPI communicators only, so a process loads them only once
its MPI is up (`module`): a job whose backend has no MPI world (`horovodrun
--gloo`) never imports mpi4py's MPI for them, since that import initialises
MPI, and an Open MPI singleton starts a daemon and transports whose ports
listen on every interface for the whole job.

Run as `python -m engine.fastpath` to build for the MPI mpi4py loads now.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

from ..base import settings

log = logging.getLogger("asynclock")
HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_fastpath.c"


def library_tag() -> str:
    """Which MPI library this process uses (mpi4py loads it on import, and initialises
    MPI unless it is up already: callers are processes whose MPI is up or meant to be,
    as `module` and the build are)."""
    from mpi4py import MPI

    return f"{zlib.crc32(MPI.Get_library_version().encode()):08x}"


def built_path(tag: str | None = None) -> Path:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return HERE / f"_fastpath_{tag or library_tag()}{suffix}"


def load() -> ModuleType | None:
    """The extension built for this MPI and this source, or None (Python path)."""
    if not settings.flag("ASYNCLOCK_FASTPATH"):
        return None
    path = built_path()
    if not path.exists():
        return None
    if path.stat().st_mtime < SOURCE.stat().st_mtime:
        # Built from an older source: its wire format may differ from the Python round's.
        # Say so, since the Python round is slower (launch/setup.sh rebuilds it).
        log.warning("asynclock: the C small-message round %s is older than its source; "
                    "using the Python round until `python mpi/build_fastpath.py` (or "
                    "launch/setup.sh) rebuilds it", path.name)
        return None
    loader = importlib.machinery.ExtensionFileLoader("asynclock._fastpath", str(path))
    spec = importlib.util.spec_from_file_location("asynclock._fastpath", path, loader=loader)
    if spec is None:
        return None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_MODULE: list[ModuleType | None] = []  # loaded once per process


def module() -> ModuleType | None:
    """The loaded extension for this process, or None: None without loading anything
    while MPI is not up here (it has no communicator for the extension to run on)."""
    if not _MODULE:
        if not mpi_up():
            return None
        _MODULE.append(_load_quietly())
    return _MODULE[0]


def mpi_up() -> bool:
    """MPI is initialised in this process; asks nothing of an MPI not imported yet."""
    mpi: Any = sys.modules.get("mpi4py.MPI")
    return mpi is not None and bool(mpi.Is_initialized()) and not mpi.Is_finalized()


def header_comm(transport: Any) -> Any:
    """The transport's MPI header communicator, or None."""
    comm = getattr(transport, "hdr", None)
    if comm is None:
        comm = getattr(getattr(transport, "mpi", None), "hdr", None)
    return comm


def compact_round_for(transport: Any, send: Any, recv: Any) -> Any:
    """A C compact round on the transport's header communicator, or None."""
    comm, mod = header_comm(transport), module()
    if comm is None or mod is None:
        return None
    from mpi4py import MPI

    return mod.CompactRound(MPI._addressof(comm), send.ctypes.data, recv.ctypes.data)


def compact_starter(transport: Any) -> Any:
    """`start(send, recv) -> Request`: the general path's compact round with the C op,
    or None where the extension is not loaded."""
    comm, mod = header_comm(transport), module()
    if comm is None or mod is None:
        return None
    from mpi4py import MPI

    comm_addr, start = MPI._addressof(comm), mod.start_compact

    def begin(send: Any, recv: Any) -> Any:
        req = MPI.Request()
        start(comm_addr, send.ctypes.data, recv.ctypes.data, MPI._addressof(req))
        return req

    return begin


def _load_quietly() -> ModuleType | None:
    try:
        return load()
    except (ImportError, OSError) as exc:  # built for another interpreter or MPI
        log.warning("asynclock: C small-message path not loaded (%s); using Python", exc)
        return None


# Records per rank in a node round's segment: how many compact rounds a rank may
# start before every rank has read the oldest (more wait, unwritten, in their requests).
NODE_DEPTH = 64


def node_round_for(transport: Any) -> Any:
    """Collective over the channel: a C `NodeRound` where every rank of it is on one
    node, has the extension loaded and `ASYNCLOCK_NODE_ROUND` on; else None on
    every rank (the compact round stays on MPI)."""
    make = getattr(transport, "node_segment", None)
    if make is None:
        return None
    mod = module()
    wanted = mod is not None and settings.flag("ASYNCLOCK_NODE_ROUND")
    rank_bytes = NODE_DEPTH * (mod.REC_BYTES + 8) if mod is not None else 0
    segment = make(wanted, rank_bytes)
    if segment is None or mod is None:
        return None
    return mod.NodeRound(segment.address, segment.nbytes, segment.rank, segment.size,
                         NODE_DEPTH, segment)


# Records per rank in a node data segment: data rounds a rank may start before every
# rank has read its oldest (more wait, unwritten, in their requests).
DATA_DEPTH = 2


def node_data_for(transport: Any, node_round: Any) -> Any:
    """Collective over the channel, made right after its `node_round` (None on every
    rank or on none): a C `NodeData` for the data of allreduces up to
    ASYNCLOCK_NODE_DATA_MAX_BYTES, handed to the channel (`use_node_data`), where it
    has a node round, every rank wants one and none sends CUDA memory to MPI itself
    (that rank's allreduces must stay on MPI); else None on every rank."""
    use = getattr(transport, "use_node_data", None)
    slot = int(settings.number("ASYNCLOCK_NODE_DATA_MAX_BYTES"))  # agreed
    if node_round is None or use is None or slot <= 0:
        return None
    from ..device.paths import cuda_support

    mod = module()
    assert mod is not None  # a node round is C
    slot += -slot % 64
    segment = transport.node_segment(not cuda_support().direct,
                                     DATA_DEPTH * (mod.DATA_HEAD + slot + 8))
    if segment is None:
        return None
    data = mod.NodeData(segment.address, segment.nbytes, segment.rank, segment.size,
                        DATA_DEPTH, slot, segment)
    use(data)
    return data


def arm_window(transport: Any) -> None:
    """Hand the channel's node window, where it has one, the C steps of the allreduces
    the loop runs through it (`NodeWindow.use_c_steps`). Local, not collective: the C
    and Python steps share the window's counters and bells, so ranks may differ."""
    view = transport.bulk_view() if hasattr(transport, "bulk_view") else None
    window = getattr(view, "window", None)
    mod = module()
    if window is not None and mod is not None:
        window.use_c_steps(mod.WindowSteps)


def hot_allreduce(rnd: Any, *args: Any) -> Any:
    """The C `HotAllreduce` on `rnd`, a C compact round, made with `args` (see
    `engine.small_calls`); None where `rnd` is Python's."""
    mod = module()
    if mod is None or not isinstance(rnd, (mod.CompactRound, mod.NodeCompactRound)):
        return None
    return mod.HotAllreduce(*args, rnd)


def take_request(rnd: Any) -> Any:
    """The C round's request in flight, as a request the engine can own: the node
    round's own, or an mpi4py Request."""
    if not isinstance(rnd, module().CompactRound):  # type: ignore[union-attr]
        return rnd.give()
    from mpi4py import MPI

    req = MPI.Request()
    rnd.give(MPI._addressof(req))
    return req


def compiler() -> str | None:
    """The wrapper of the MPI mpi4py loads: MPICH's in this venv, else Open MPI's."""
    from mpi4py import MPI

    names = ["mpicc.openmpi", "mpicc"] if "Open MPI" in MPI.Get_library_version() else [
        str(Path(sys.prefix) / "bin" / "mpicc"), "mpicc.mpich", "mpicc"]
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def build() -> Path:
    """Compile for the MPI this process uses; raises with the compiler's output."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no mpicc for this MPI: the Python small-message path stays")
    out = built_path()
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-shared", "-fPIC", "-Wall", f"-I{sysconfig.get_paths()['include']}",
           str(SOURCE), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")
    tmp.replace(out)  # atomic: a running rank never loads a half-written file
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        path = build()
    except RuntimeError as exc:
        print(f"fastpath: not built: {exc}", file=sys.stderr)
        return 1
    module: Any = load()
    print(f"fastpath: built {path.name}" + ("" if module else " (but it does not load)"))
    return 0 if module else 1


if __name__ == "__main__":
    sys.exit(main())
