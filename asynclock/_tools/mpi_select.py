"""Choose which MPI the project runs on, and say how to run it.

Two MPIs can live on a machine here, and mixing them silently breaks things
(every rank becomes a singleton of size 1, or Horovod crashes in MPI_Init):

* ``embedded`` -- the pip ``mpich`` wheel inside the venv (``.venv/bin/mpiexec``,
  ``.venv/lib/libmpi.so.12``).  Always there; no root, no apt.
* ``system``   -- Debian's Open MPI 4 (``/usr/bin/mpirun.openmpi``,
  ``/usr/lib/<multiarch>/libmpi.so.40``), installed by
  ``mpi/install_system_mpi.sh``.  horovodrun's MPI controller needs it.

mpi4py 4 picks its libmpi at *run time* (``MPI4PY_LIBMPI``), and by default
finds the venv's MPICH first.  Open MPI's ``mpirun`` + MPICH libmpi aborts in
MPI_Init ("unsupported PMI version PMIx"); MPICH's ``mpiexec`` + Open MPI
libmpi silently gives N singletons of size 1 (with only a RuntimeWarning).
This module therefore always hands out the launcher and the environment
together.

It lives in the package so that `asynclock-launch` and `horovodrun` have it
from an installed wheel too, where there is no ``mpi/`` folder. It imports the
standard library only, nothing of asynclock: ``mpi/mpi_select.py`` loads it
into any python3, where importing the package would need its dependencies.

Command line (stdlib only, any python3)::

    eval "$(python mpi/mpi_select.py env [embedded|system|auto])"
    $(python mpi/mpi_select.py launcher [kind] -n 3) python script.py
    python mpi/mpi_select.py info [kind|all]          # JSON
    python mpi/mpi_select.py describe [kind]          # one line

(in the venv, ``python -m asynclock._tools.mpi_select`` is the same command).
From Python::

    from asynclock._tools import mpi_select    # or, in the repository's kit: import mpi_select
    env = mpi_select.environ_for("auto")      # full environ copy for subprocess
    argv = mpi_select.launcher("auto", 3) + [sys.executable, "script.py"]
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import shlex
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any

KINDS = ("embedded", "system")
Info = dict[str, Any]  # what describe() returns
# In a checkout, the repository (its .venv is the fallback of `venv_prefix`); from a
# wheel, a folder without one, so the fallback finds nothing there.
REPO_ROOT = Path(__file__).resolve().parents[2]

# Open MPI binaries exposed through the shim dir.  Debian installs the real
# ones as *.openmpi behind update-alternatives; /usr/bin/mpirun may point to
# MPICH if that is installed too, so the shims name the Open MPI ones directly.
_OMPI_TOOLS = {
    "mpirun": "mpirun.openmpi",
    "mpiexec": "mpiexec.openmpi",
    "mpicc": "mpicc.openmpi",
    "mpicxx": "mpicxx.openmpi",
    "mpic++": "mpic++.openmpi",
    "mpiCC": "mpiCC.openmpi",
    "ompi_info": "ompi_info",
    "orterun": "orterun",
    "orted": "orted",
}


def venv_prefix() -> Path:
    """Return the venv whose python the ranks run (its bin/ holds mpiexec).

    Order: ASYNCLOCK_VENV, the running interpreter's venv, VIRTUAL_ENV, then
    the repo's .venv -- so `python3 mpi/mpi_select.py` from the system python still
    finds the project's venv.
    """
    forced = os.environ.get("ASYNCLOCK_VENV")
    if forced:
        return Path(forced).resolve()
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix)
    active = os.environ.get("VIRTUAL_ENV")
    if active and Path(active, "bin").is_dir():
        return Path(active)
    return REPO_ROOT / ".venv"


def cache_root() -> Path:
    """Return the per-user cache root (ASYNCLOCK_CACHE overrides it)."""
    forced = os.environ.get("ASYNCLOCK_CACHE")
    if forced:
        return Path(forced).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "asynclock"


def system_libdir() -> Path:
    """Return Debian's multiarch lib dir, where libmpi.so.40 lives."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    return Path("/usr/lib") / multiarch


def shim_dir() -> Path:
    """Return the dir of Open MPI shims that goes first on PATH for 'system'.

    Putting /usr/bin first would also shadow the venv's python3/pip, so only
    the MPI tools get symlinked into a private dir.
    """
    return cache_root() / "mpi" / "openmpi" / "bin"


def ensure_shims() -> Path:
    """Create (idempotently) the symlinks of the Open MPI shim dir."""
    target_dir = shim_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    for name, real in _OMPI_TOOLS.items():
        real_path = Path("/usr/bin") / real
        link = target_dir / name
        if not real_path.exists():
            continue
        if link.is_symlink() and os.readlink(link) == str(real_path):
            continue
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(real_path)
    return target_dir


def _first_existing(*paths: Path) -> Path | None:
    """Return the first path that exists, else None."""
    for path in paths:
        if path.exists():
            return path
    return None


def describe_embedded() -> Info:
    """Describe the pip MPICH wheel in the venv (paths only, no subprocess)."""
    venv = venv_prefix()
    bindir, libdir = venv / "bin", venv / "lib"
    libmpi = _first_existing(libdir / "libmpi.so.12", libdir / "libmpi.so")
    mpiexec = _first_existing(bindir / "mpiexec.hydra", bindir / "mpiexec")
    mpicc = _first_existing(bindir / "mpicc")
    ok = libmpi is not None and mpiexec is not None
    return {
        "kind": "embedded",
        "vendor": "MPICH",
        "available": ok,
        "reason": "" if ok else f"no libmpi/mpiexec under {venv} (pip install mpich)",
        "bin_dir": str(bindir),
        "mpiexec": str(bindir / "mpiexec") if mpiexec else None,
        "mpicc": str(mpicc) if mpicc else None,
        "libmpi": str(libmpi) if libmpi else None,
        "include_dir": str(venv / "include") if (venv / "include" / "mpi.h").exists() else None,
    }


def describe_system() -> Info:
    """Describe Debian's Open MPI (paths only, no subprocess)."""
    libmpi = _first_existing(system_libdir() / "libmpi.so.40")
    mpirun = _first_existing(Path("/usr/bin/mpirun.openmpi"))
    mpicc = _first_existing(Path("/usr/bin/mpicc.openmpi"))
    ok = libmpi is not None and mpirun is not None
    return {
        "kind": "system",
        "vendor": "Open MPI",
        "available": ok,
        "reason": "" if ok else "Open MPI not installed (run: bash mpi/install_system_mpi.sh)",
        "bin_dir": str(shim_dir()),
        "mpiexec": str(shim_dir() / "mpirun") if mpirun else None,
        "mpicc": str(shim_dir() / "mpicc") if mpicc else None,
        "libmpi": str(libmpi) if libmpi else None,
        "include_dir": str(system_libdir() / "openmpi" / "include") if mpicc else None,
    }


def resolve(kind: str = "auto") -> str:
    """Map 'auto' to 'system' when Open MPI is installed, else 'embedded'.

    ASYNCLOCK_MPI (set by `env` output) makes 'auto' sticky in child shells.
    """
    if kind == "auto":
        kind = os.environ.get("ASYNCLOCK_MPI", "auto")
    if kind == "auto":
        return "system" if describe_system()["available"] else "embedded"
    if kind not in KINDS:
        raise ValueError(f"unknown MPI kind {kind!r}; choose from {KINDS + ('auto',)}")
    return kind


def describe(kind: str = "auto") -> Info:
    """Return a dict describing MPI `kind` ('embedded', 'system' or 'auto')."""
    kind = resolve(kind)
    return describe_system() if kind == "system" else describe_embedded()


def available() -> dict[str, bool]:
    """Return which MPI kinds are usable on this machine."""
    return {"embedded": describe_embedded()["available"], "system": describe_system()["available"]}


@functools.lru_cache(maxsize=1)
def cma_works() -> bool:
    """Probe whether cross-memory attach (process_vm_readv) works here.

    Open MPI's vader BTL copies large shared-memory messages with CMA; in
    containers without CAP_SYS_PTRACE / with seccomp it fails at run time
    ("Read -1, expected N, errno = 1").  We do what vader does: read a
    forked child's memory.  False means: set single_copy_mechanism=none.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        readv = libc.process_vm_readv
    except (OSError, AttributeError):
        return False
    src = ctypes.create_string_buffer(b"asynclock-cma-probe", 32)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: keep the page alive until the parent has read it
        os.close(wfd)
        os.read(rfd, 1)
        os._exit(0)
    os.close(rfd)
    try:
        return _read_child(readv, pid, src)
    finally:
        os.close(wfd)
        os.waitpid(pid, 0)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _read_child(readv: Any, pid: int, src: ctypes.Array[ctypes.c_char]) -> bool:
    """Read `src` (same address in the forked child) via process_vm_readv."""
    dst = ctypes.create_string_buffer(len(src))
    local = _IoVec(ctypes.cast(dst, ctypes.c_void_p), len(src))
    remote = _IoVec(ctypes.cast(src, ctypes.c_void_p), len(src))
    readv.restype = ctypes.c_ssize_t
    readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                      ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    got = readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return got == len(src) and dst.raw == src.raw


def _path_without_ours(path: str) -> list[str]:
    """Split PATH and drop dirs this module manages, so switching kinds works."""
    ours = {str(shim_dir()), str(venv_prefix() / "bin")}
    return [p for p in path.split(os.pathsep) if p and p not in ours]


def openmpi_settings() -> dict[str, str]:
    """Return the OMPI_* variables Open MPI needs on this kind of machine.

    - root: Open MPI refuses to run as root without both ALLOW flags.
    - oversubscribe: 3 ranks on 2 cores fails with "not enough slots" else.
    - binding none: default bind-to-core pins a rank's torch threads and the
      Horovod background thread to one core; on a shared 2-core box that hurts.
    - vader CMA off where the probe says containers forbid it.
    """
    env = {
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMPI_MCA_hwloc_base_binding_policy": "none",
    }
    if os.geteuid() == 0:
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    if not cma_works():
        env["OMPI_MCA_btl_vader_single_copy_mechanism"] = "none"
    return env


def env_vars(kind: str = "auto", base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return the variables to set (not the whole environment) for `kind`."""
    base = os.environ if base is None else base
    info = describe(kind)
    if not info["available"]:
        raise RuntimeError(info["reason"])
    rest = _path_without_ours(base.get("PATH", os.defpath))
    env = {"ASYNCLOCK_MPI": info["kind"], "MPI4PY_LIBMPI": info["libmpi"]}
    if info["kind"] == "system":
        ensure_shims()
        env["PATH"] = os.pathsep.join([str(shim_dir()), str(venv_prefix() / "bin"), *rest])
        env.update(openmpi_settings())
    else:
        env["PATH"] = os.pathsep.join([str(venv_prefix() / "bin"), *rest])
    return env


def stale_vars(kind: str = "auto", base: Mapping[str, str] | None = None) -> list[str]:
    """Return variables set for the other kind that should go (OMPI_* for MPICH)."""
    base = os.environ if base is None else base
    if resolve(kind) == "system":
        return []
    return sorted(k for k in base if k.startswith("OMPI_"))


def environ_for(kind: str = "auto", base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return a full environment (copy of `base`/os.environ) set up for `kind`."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if k not in stale_vars(kind, base)}
    env.update(env_vars(kind, base))
    return env


def launcher(kind: str = "auto", nranks: int = 2) -> list[str]:
    """Return the mpiexec argv prefix for `nranks` ranks of MPI `kind`.

    Self-contained on purpose: it carries MPI4PY_LIBMPI (and for Open MPI the
    root/oversubscribe flags) so it works even if `env` was not applied.
    MPICH hydra oversubscribes by default; Open MPI 4 needs --oversubscribe.
    """
    info = describe(kind)
    if not info["available"]:
        raise RuntimeError(info["reason"])
    if info["kind"] == "embedded":
        return [info["mpiexec"], "-n", str(nranks), "-genv", "MPI4PY_LIBMPI", info["libmpi"]]
    ensure_shims()
    argv = [info["mpiexec"], "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    if not cma_works():
        argv += ["--mca", "btl_vader_single_copy_mechanism", "none"]
    return argv + ["-np", str(nranks), "-x", f"MPI4PY_LIBMPI={info['libmpi']}"]


def summary(kind: str = "auto") -> str:
    """Return one line saying which MPI `kind` resolves to and where it lives."""
    info = describe(kind)
    if not info["available"]:
        return f"{info['kind']} ({info['vendor']}): unavailable: {info['reason']}"
    return (f"{info['kind']} ({info['vendor']}): mpiexec={info['mpiexec']} "
            f"libmpi={info['libmpi']}")


def _print_env(kind: str, fmt: str) -> None:
    """Print env_vars as shell exports or JSON."""
    env = env_vars(kind)
    if fmt == "json":
        print(json.dumps(env, indent=2, sort_keys=True))
        return
    for key in stale_vars(kind):
        print(f"unset {key}")
    for key in sorted(env):
        print(f"export {key}={shlex.quote(env[key])}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: env | launcher | info | describe."""
    parser = argparse.ArgumentParser(prog="mpi_select.py",
                                     description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_env = sub.add_parser("env", help="print export lines for an MPI kind")
    p_env.add_argument("kind", nargs="?", default="auto", choices=KINDS + ("auto",))
    p_env.add_argument("--format", choices=("sh", "json"), default="sh")
    p_launch = sub.add_parser("launcher", help="print the mpiexec prefix for N ranks")
    p_launch.add_argument("kind", nargs="?", default="auto", choices=KINDS + ("auto",))
    p_launch.add_argument("-n", "--nranks", type=int, default=2)
    p_info = sub.add_parser("info", help="print a JSON description of an MPI kind")
    p_info.add_argument("kind", nargs="?", default="auto", choices=KINDS + ("auto", "all"))
    p_desc = sub.add_parser("describe", help="print a one-line summary of an MPI kind")
    p_desc.add_argument("kind", nargs="?", default="auto", choices=KINDS + ("auto",))
    args = parser.parse_args(argv)
    try:
        if args.cmd == "env":
            _print_env(args.kind, args.format)
        elif args.cmd == "launcher":
            print(shlex.join(launcher(args.kind, args.nranks)))
        elif args.cmd == "describe":
            print(summary(args.kind))
        else:
            kinds = KINDS if args.kind == "all" else (args.kind,)
            print(json.dumps({k: describe(k) for k in kinds} if args.kind == "all"
                             else describe(kinds[0]), indent=2))
    except (RuntimeError, ValueError) as exc:
        print(f"mpi_select.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
