#!/usr/bin/env python3
"""Build Horovod from the PyPI sdist against this venv's torch and a chosen MPI.

Why build: there are no Horovod wheels on PyPI, the 0.28.1 sdist predates
torch 2.x's C++17 requirement and CMake 4's policy floor, and Horovod must
link the *same* libmpi that mpi4py loads (MPI4PY_LIBMPI), or hvd.init() and
mpi4py end up in two different MPI worlds.  The wheel is cached under
$ASYNCLOCK_CACHE/horovod (default ~/.cache/asynclock/horovod) keyed by
(horovod, torch, MPI vendor+version+libmpi, python), so a re-run with the same
key only checks and exits in seconds.

Usage::

    python3 mpi/build_horovod.py [--mpi system|embedded|auto] [--force]
                                 [--jobs 2] [--nice 10] [--no-verify] [--wheel-only]

Default MPI is 'system' (Debian Open MPI): horovodrun's MPI controller only
recognises Open MPI here.  Run mpi/install_system_mpi.sh first.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # mpi_select, the kit's selector
import mpi_select  # noqa: E402

HOROVOD_VERSION = "0.28.1"
RUNTIME_DEPS = ["cloudpickle", "psutil", "pyyaml", "packaging", "cffi"]
BUILD_ENV = {
    "HOROVOD_WITH_PYTORCH": "1",
    "HOROVOD_WITH_MPI": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "HOROVOD_CPU_OPERATIONS": "MPI",
    "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
}
STAMP_NAME = "asynclock-horovod-key.json"


def log(msg: str) -> None:
    """Print a progress line at once (the build is long; buffering hides it)."""
    print(f"[build_horovod] {msg}", flush=True)


def venv_python() -> Path:
    """Return the python of the venv that gets Horovod (it owns torch)."""
    return mpi_select.venv_prefix() / "bin" / "python"


def run(cmd: list[str], env: dict[str, str] | None = None, nice: int = 0,
        capture: bool = False, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command, echoing it; fail loudly with its output on error."""
    log("$ " + " ".join(cmd))
    preexec = (lambda: os.nice(nice)) if nice else None
    proc = subprocess.run(cmd, env=env, cwd=cwd, text=True, preexec_fn=preexec,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.STDOUT if capture else None)
    if proc.returncode != 0:
        if capture:
            print(proc.stdout, file=sys.stderr)
        raise SystemExit(f"[build_horovod] command failed ({proc.returncode}): {' '.join(cmd)}")
    return proc


def py_query(code: str, env: dict[str, str] | None = None) -> str:
    """Evaluate a snippet in the venv python and return its stripped stdout."""
    out = subprocess.run([str(venv_python()), "-c", code], env=env, text=True,
                         capture_output=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def mpi_library_version(libmpi: str) -> str:
    """Return MPI_Get_library_version's first line (callable before MPI_Init)."""
    lib = ctypes.CDLL(libmpi, mode=os.RTLD_LOCAL)
    buf = ctypes.create_string_buffer(8192)
    length = ctypes.c_int(0)
    if lib.MPI_Get_library_version(buf, ctypes.byref(length)) != 0:
        return "unknown"
    return buf.value.decode(errors="replace").strip().splitlines()[0].strip()


def build_key(version: str, kind: str) -> dict[str, str]:
    """Collect what the built wheel depends on: change any, rebuild."""
    info = mpi_select.describe(kind)
    return {
        "horovod": version,
        "torch": py_query("import torch; print(torch.__version__)") or "missing",
        "mpi_kind": info["kind"],
        "mpi_vendor": info["vendor"],
        "mpi_version": mpi_library_version(info["libmpi"]),
        "libmpi": os.path.realpath(info["libmpi"]),
        "python": py_query("import sys; print('%d.%d.%d' % sys.version_info[:3])"),
    }


def key_dir(key: dict[str, str]) -> Path:
    """Return the cache dir of one key: readable prefix + hash of the whole key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    slug = f"horovod-{key['horovod']}_torch-{key['torch']}_{key['mpi_kind']}_py{key['python']}"
    slug = re.sub(r"[^A-Za-z0-9._-]", "_", slug)  # no '+': see build_dir()
    return mpi_select.cache_root() / "horovod" / f"{slug}_{digest}"


def build_dir(kdir: Path) -> Path:
    """Return a scratch dir for the build whose path is regex-safe.

    Horovod's cmake/Utilities.cmake strips PROJECT_SOURCE_DIR from paths with
    string(REGEX REPLACE ...): a '+' (e.g. 'torch-2.13.0+cpu') or other regex
    character in the source path makes the .so land under
    build/lib*/<absolute path>/horovod/torch/ and the wheel ships no
    extension.  The dir is stable per key so a retried build is incremental.
    """
    path = kdir.parent / "build" / kdir.name
    if re.fullmatch(r"[A-Za-z0-9._/-]+", str(path)):
        return path
    return Path(tempfile.gettempdir()) / "asynclock-horovod-build" / kdir.name[-12:]


def cached_wheel(kdir: Path) -> Path | None:
    """Return the cached wheel of a key, if a previous build finished."""
    wheels = sorted(kdir.glob("horovod-*.whl"))
    return wheels[-1] if wheels and (kdir / "key.json").exists() else None


def launcher_checked(kdir: Path) -> Path:
    """Return the file that says this key's wheel passed `horovodrun --check-build`."""
    return kdir / "check-build.ok"


def stamp_path() -> Path:
    """Return where we record which key is installed in the venv."""
    return mpi_select.venv_prefix() / STAMP_NAME


def installed_matches(key: dict[str, str]) -> bool:
    """True when the venv has Horovod installed from a wheel of this key."""
    try:
        stamp = json.loads(stamp_path().read_text())
    except (OSError, ValueError):
        return False
    have = py_query("import importlib.metadata as m; print(m.version('horovod'))")
    return stamp == key and have.split("+")[0] == key["horovod"]


def ensure_runtime_deps() -> None:
    """Install horovodrun's python deps (never torch: they don't need it)."""
    probe = "import cloudpickle, psutil, yaml, packaging, cffi"
    if subprocess.run([str(venv_python()), "-c", probe], capture_output=True).returncode == 0:
        log("runtime deps present: " + ", ".join(RUNTIME_DEPS))
        return
    uv = venv_python().with_name("uv")  # launch/setup.sh's: parallel downloads
    if uv.exists():
        run([str(uv), "pip", "install", "-q", "--compile-bytecode", "--python",
             str(venv_python()), *RUNTIME_DEPS])
    else:
        run([str(venv_python()), "-m", "pip", "install", "-q", *RUNTIME_DEPS])


def ensure_cmake(env: dict[str, str]) -> str:
    """Return a cmake >= 3.13 (system one if fine, else pip cmake in the venv)."""
    for cand in (shutil.which("cmake", path=env["PATH"]),):
        if cand and _cmake_version(cand) >= (3, 13):
            return cand
    run([str(venv_python()), "-m", "pip", "install", "-q", "cmake"])
    return str(mpi_select.venv_prefix() / "bin" / "cmake")


def _cmake_version(cmake: str) -> tuple[int, ...]:
    """Return cmake's version as a tuple ((0,) when it does not run)."""
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return (0,)
    match = re.search(r"version\s+(\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else (0,)


def fetch_sdist(version: str) -> Path:
    """Download (once) the Horovod sdist into the cache and return its path."""
    sdist_dir = mpi_select.cache_root() / "horovod" / "sdist"
    tarball = sdist_dir / f"horovod-{version}.tar.gz"
    if tarball.exists():
        log(f"sdist cached: {tarball}")
        return tarball
    sdist_dir.mkdir(parents=True, exist_ok=True)
    run([str(venv_python()), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
         "--no-build-isolation", f"horovod=={version}", "-d", str(sdist_dir)])
    return tarball


def unpack_and_patch(tarball: Path, workdir: Path) -> Path:
    """Unpack the sdist and apply the C++17 patch torch 2.x needs.

    A source tree left by an earlier (failed) try is reused as is: tar keeps
    mtimes, so make only redoes what is missing.
    """
    marker = workdir / ".asynclock-patched"
    if marker.exists():
        log(f"reusing patched source in {workdir}")
        return next(workdir.glob("horovod-*/"))
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        if hasattr(tarfile, "data_filter"):  # 3.11.4+: refuse odd members
            tar.extractall(workdir, filter="data")
        else:
            tar.extractall(workdir)
    src = next(workdir.glob("horovod-*"))
    for rel in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
        path = src / rel
        text = path.read_text()
        patched = text.replace("CMAKE_CXX_STANDARD 14", "CMAKE_CXX_STANDARD 17")
        log(f"patch {rel}: C++14 -> C++17 ({text.count('CMAKE_CXX_STANDARD 14')} place(s))")
        path.write_text(patched)
    marker.touch()
    return src


def build_env(kind: str, jobs: int, cmake: str) -> dict[str, str]:
    """Return the environment for the wheel build: chosen MPI first on PATH.

    CMake's FindMPI searches mpiexec/mpicc on PATH; the selected MPI's bin dir
    (Open MPI shims or the venv bin) comes first so it wins.  MPI_HOME is a
    second hint for FindMPI.
    """
    env = mpi_select.environ_for(kind)
    env.update(BUILD_ENV)
    env["MAKEFLAGS"] = f"-j{jobs}"
    info = mpi_select.describe(kind)
    env["MPI_HOME"] = "/usr" if info["kind"] == "system" else str(mpi_select.venv_prefix())
    cmake_dir = str(Path(cmake).parent)
    if shutil.which("cmake", path=env["PATH"]) != cmake:
        env["PATH"] = os.pathsep.join([env["PATH"], cmake_dir])
    return env


def build_wheel(version: str, kind: str, kdir: Path, jobs: int, nice: int) -> Path:
    """Build the wheel into kdir (via a scratch dir, so a failed build leaves no wheel)."""
    tarball = fetch_sdist(version)
    env0 = mpi_select.environ_for(kind)
    cmake = ensure_cmake(env0)
    log(f"cmake: {cmake} {'.'.join(map(str, _cmake_version(cmake)))}")
    scratch = build_dir(kdir)
    src = unpack_and_patch(tarball, scratch / "src")
    env = build_env(kind, jobs, cmake)
    log("mpicc on PATH: " + str(shutil.which("mpicc", path=env["PATH"])))
    out = scratch / "wheel"
    shutil.rmtree(out, ignore_errors=True)
    start = time.monotonic()
    run([str(venv_python()), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-cache-dir", "-w", str(out), str(src)], env=env, nice=nice)
    log(f"build time: {time.monotonic() - start:.0f} s")
    wheel = next(out.glob("horovod-*.whl"))
    check_wheel(wheel)
    kdir.mkdir(parents=True, exist_ok=True)
    final = kdir / wheel.name
    shutil.move(str(wheel), final)
    shutil.rmtree(scratch, ignore_errors=True)
    return final


def check_wheel(wheel: Path) -> None:
    """Refuse to cache a wheel without horovod/torch/mpi_lib_v2*.so in place."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    good = [n for n in names if re.fullmatch(r"horovod/torch/mpi_lib_v2[^/]*\.so", n)]
    if not good:
        stray = [n for n in names if n.endswith(".so")]
        raise SystemExit(f"[build_horovod] {wheel.name} lacks horovod/torch/mpi_lib_v2*.so "
                         f"(shared objects in it: {stray})")
    log(f"wheel ok: {good[0]}")


def install_wheel(wheel: Path) -> None:
    """pip install the wheel without deps (so torch is never touched)."""
    stamp_path().unlink(missing_ok=True)
    run([str(venv_python()), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
         str(wheel)])


HOROVODRUN = """#!{python}
# horovodrun with the environment of the MPI Horovod is built for (MPICH's mpirun
# comes first on an activated venv's PATH): see asynclock/hvdrun.py. Written by
# mpi/build_horovod.py in place of Horovod's own script, which it then runs.
import sys

try:
    from asynclock.hvdrun import main
except Exception:  # no (working) asynclock in this venv: Horovod's own entry
    from horovod.runner.launch import run_commandline as main
if __name__ == "__main__":
    sys.exit(main())
"""


def install_horovodrun() -> None:
    """Put our `horovodrun` in the venv's bin/ (idempotent; pip rewrites it on
    every Horovod install, so this runs after each, and on every up-to-date check)."""
    path = mpi_select.venv_prefix() / "bin" / "horovodrun"
    text = HOROVODRUN.format(python=venv_python())
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(".horovodrun.tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(path)
    log(f"installed {path} (the MPI controller gets the environment of Horovod's MPI)")


def verify(kind: str, launcher: bool = True) -> None:
    """Check Horovod imports, initialises, and reports MPI+Gloo built; with `launcher`,
    also that `horovodrun --check-build` runs (slow to start: once per cached wheel,
    `launcher_checked`)."""
    env = mpi_select.environ_for(kind)
    code = ("import horovod.torch as hvd; hvd.init(); "
            "print('mpi_built', hvd.mpi_built(), 'gloo_built', hvd.gloo_built(), "
            "'size', hvd.size()); hvd.shutdown()")
    run([str(venv_python()), "-c", code], env=env)
    if launcher:
        horovodrun = str(mpi_select.venv_prefix() / "bin" / "horovodrun")
        run([horovodrun, "--check-build"], env=env)


def main(argv: list[str] | None = None) -> int:
    """Entry point: build (or reuse) the wheel, install it, verify it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mpi", default="system", choices=mpi_select.KINDS + ("auto",))
    parser.add_argument("--version", default=HOROVOD_VERSION)
    parser.add_argument("--jobs", type=int, default=2, help="MAKEFLAGS=-jN (default 2)")
    parser.add_argument("--nice", type=int, default=10, help="niceness of the build (default 10)")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--wheel-only", action="store_true",
                        help="build/cache the wheel but leave the venv alone")
    args = parser.parse_args(argv)
    start = time.monotonic()
    kind = mpi_select.resolve(args.mpi)
    info = mpi_select.describe(kind)
    if not info["available"]:
        raise SystemExit(f"[build_horovod] {info['reason']}")
    ensure_runtime_deps()
    key = build_key(args.version, kind)
    kdir = key_dir(key)
    log("key: " + json.dumps(key, sort_keys=True))
    if not args.force and installed_matches(key) and cached_wheel(kdir):
        install_horovodrun()
        log(f"up to date: {cached_wheel(kdir)} (nothing to do, {time.monotonic() - start:.1f} s)")
        return 0
    wheel = None if args.force else cached_wheel(kdir)
    if wheel is None:
        launcher_checked(kdir).unlink(missing_ok=True)  # a new wheel is checked again
        wheel = build_wheel(args.version, kind, kdir, args.jobs, args.nice)
        (kdir / "key.json").write_text(json.dumps(key, indent=2, sort_keys=True))
    else:
        log(f"using cached wheel {wheel}")
    if args.wheel_only:
        log(f"wheel only: {wheel} ({time.monotonic() - start:.0f} s)")
        return 0
    install_wheel(wheel)
    install_horovodrun()
    if not args.no_verify:
        checked = launcher_checked(kdir)
        verify(kind, launcher=not checked.exists())
        checked.touch()
    stamp_path().write_text(json.dumps(key, indent=2, sort_keys=True))  # only once it works
    log(f"done in {time.monotonic() - start:.0f} s; wheel {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
