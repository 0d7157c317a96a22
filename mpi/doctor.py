#!/usr/bin/env python3
"""Report which MPI, torch and Horovod this machine would actually use.

Why: most MPI failures here are silent mismatches -- mpi4py loading MPICH
while ranks were started by Open MPI's mpirun (N singletons), or Horovod
linked against one libmpi while mpi4py loaded another.  The doctor runs the
same probes under the environment mpi/mpi_select.py would hand out, so what it
prints is what a launched rank sees.  It never fails because something is
missing; it says "not installed" instead.

Usage::

    python3 mpi/doctor.py [--mpi auto|embedded|system] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # mpi_select, the kit's selector
import mpi_select  # noqa: E402

TIMEOUT_S = 120
Report = dict[str, Any]

# Runs inside the venv python under the selected MPI env (a singleton rank).
_MPI_PROBE = r"""
import ctypes, json, os
from mpi4py import MPI
out = {"library_version": MPI.Get_library_version().strip().splitlines()[0].strip(),
       "standard": "%d.%d" % MPI.Get_version(), "mpi4py_abi": None}
try:
    from mpi4py import _mpiabi
    out["mpi4py_abi"] = _mpiabi._get_mpiabi()
except Exception:
    pass
levels = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
          MPI.THREAD_SERIALIZED: "SERIALIZED", MPI.THREAD_MULTIPLE: "MULTIPLE"}
out["thread_level"] = levels.get(MPI.Query_thread(), str(MPI.Query_thread()))
with open("/proc/self/maps") as maps:
    libs = sorted({line.split()[-1] for line in maps if "/libmpi" in line})
out["loaded_libmpi"] = [os.path.realpath(p) for p in libs]
cuda = "unknown"
if hasattr(MPI, "Query_cuda_support"):
    cuda = bool(MPI.Query_cuda_support())
else:
    for path in libs:
        fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        if fn is not None:
            cuda = bool(fn())
            break
out["cuda_runtime"] = cuda
print(json.dumps(out))
"""

_TORCH_PROBE = r"""
import json, torch
print(json.dumps({"version": torch.__version__, "cuda_available": torch.cuda.is_available(),
                  "cuda_version": torch.version.cuda, "threads": torch.get_num_threads()}))
"""

_FAST_PROBE = r"""
import json, os
import asynclock._core.engine.fastpath as f
path = f.built_path()
try:
    loaded = f.load() is not None
except Exception as exc:
    loaded = repr(exc)
print(json.dumps({"file": path.name, "built": path.exists(), "loads": loaded,
                  "enabled": os.environ.get("ASYNCLOCK_FASTPATH", "1") != "0",
                  "node_round": os.environ.get("ASYNCLOCK_NODE_ROUND", "1") != "0"
                  and os.path.isdir("/dev/shm")}))
"""

_HVD_PROBE = r"""
import glob, json, os, importlib.metadata as md
try:
    version = md.version("horovod")
except md.PackageNotFoundError:
    print(json.dumps({"installed": False})); raise SystemExit
import importlib.util
spec = importlib.util.find_spec("horovod")
pkg = os.path.dirname(spec.origin)
libs = glob.glob(os.path.join(pkg, "torch", "mpi_lib_v2*.so"))
print(json.dumps({"installed": True, "version": version, "package_dir": pkg,
                  "torch_lib": libs[0] if libs else None}))
"""


def sh(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a command; return (rc, combined output), never raising."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def py_json(code: str, env: dict[str, str]) -> Report:
    """Run a probe in the venv python; return its JSON or an error dict."""
    python = str(mpi_select.venv_prefix() / "bin" / "python")
    rc, out = sh([python, "-c", code], env)
    if rc != 0:
        return {"error": out.splitlines()[-1] if out else f"exit {rc}"}
    try:
        parsed: Report = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": out}
    return parsed


def mpiexec_report(info: Report, env: dict[str, str]) -> Report:
    """Return the launcher path and the first line of its --version."""
    exe = info.get("mpiexec")
    if not exe:
        return {"path": None, "version": "not installed"}
    rc, out = sh([exe, "--version"], env)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    version = next((ln.strip() for ln in lines if "Version" in ln or "Open MPI" in ln),
                   lines[0] if lines else "")
    if lines and "HYDRA" in lines[0]:  # MPICH: "HYDRA build details:" / "Version: x"
        version = "HYDRA (MPICH) " + version.split(":", 1)[-1].strip()
    return {"path": exe, "resolves_to": os.path.realpath(exe), "version": version}


def cuda_build_report(info: Report, env: dict[str, str]) -> str:
    """Return whether the MPI was built CUDA-aware (Open MPI: ompi_info)."""
    if info["kind"] != "system":
        return "unknown (MPICH: no build-time query; pip wheel is built without CUDA)"
    ompi_info = shutil.which("ompi_info", path=env.get("PATH"))
    if not ompi_info:
        return "unknown (ompi_info missing)"
    _, out = sh([ompi_info, "--parsable", "--all"], env)
    for line in out.splitlines():
        if "mpi_built_with_cuda_support:value" in line:
            return line.rsplit(":", 1)[-1]
    return "unknown"


def ldd_mpi(lib: str) -> list[str]:
    """Return the ldd lines of a shared object that mention an MPI library."""
    rc, out = sh(["ldd", lib])
    return [ln.strip() for ln in out.splitlines() if "mpi" in ln.lower()] if rc == 0 else [out]


def horovod_report(env: dict[str, str]) -> Report:
    """Return Horovod's install state, build flags and linked libmpi."""
    rep = py_json(_HVD_PROBE, env)
    if not rep.get("installed"):
        return {"installed": False, "note": "not installed (python3 mpi/build_horovod.py)",
                **({"error": rep["error"]} if "error" in rep else {})}
    horovodrun = mpi_select.venv_prefix() / "bin" / "horovodrun"
    _, check = sh([str(horovodrun), "--check-build"], env)
    rep["check_build"] = check
    if rep.get("torch_lib"):
        rep["ldd_mpi"] = ldd_mpi(rep["torch_lib"])
    stamp = mpi_select.venv_prefix() / "asynclock-horovod-key.json"
    rep["build_key"] = json.loads(stamp.read_text()) if stamp.exists() else None
    return rep


def mismatch_warnings(mpi: Report, hvd: Report) -> list[str]:
    """Spot the silent failures: mpi4py and Horovod on different libmpi."""
    warns = []
    loaded = mpi.get("loaded_libmpi") or []
    linked = [ln.split("=>")[-1].split("(")[0].strip() for ln in hvd.get("ldd_mpi", [])
              if "libmpi" in ln and "=>" in ln]
    linked = [os.path.realpath(p) for p in linked if p and p != "not found"]
    hvd["libmpi_matches_mpi4py"] = bool(set(linked) & set(loaded)) if loaded and linked else None
    if loaded and linked and not set(linked) & set(loaded):
        warns.append(f"Horovod links {linked} but mpi4py loads {loaded}: "
                     "build Horovod for this MPI (build_horovod.py --mpi ...)")
    if any("not found" in ln for ln in hvd.get("ldd_mpi", [])):
        warns.append("Horovod's libmpi is not found by the loader")
    return warns


def collect(kind: str) -> Report:
    """Gather the whole report as a dict."""
    report: Report = {"available": mpi_select.available()}
    try:
        info = mpi_select.describe(kind)
    except ValueError as exc:
        return {**report, "error": str(exc)}
    report["selected"] = info
    if not info["available"]:
        report["mpi"] = {"error": info["reason"]}
        env = dict(os.environ)
    else:
        env = mpi_select.environ_for(kind)
        report["env"] = mpi_select.env_vars(kind)
        report["mpi"] = py_json(_MPI_PROBE, env)
        report["mpiexec"] = mpiexec_report(info, env)
        report["mpi"]["cuda_built"] = cuda_build_report(info, env)
    report["torch"] = py_json(_TORCH_PROBE, env)
    report["fastpath"] = py_json(_FAST_PROBE, env)
    report["horovod"] = horovod_report(env)
    report["warnings"] = mismatch_warnings(report.get("mpi", {}), report["horovod"])
    return report


def render(rep: Report) -> str:
    """Format the report for people."""
    sel, mpi, hvd = rep.get("selected", {}), rep.get("mpi", {}), rep.get("horovod", {})
    lines = [f"MPI kinds available : {rep['available']}",
             f"selected            : {sel.get('kind')} ({sel.get('vendor')})"]
    mpiexec = rep.get("mpiexec", {})
    if "error" in mpi:
        lines.append(f"MPI                 : {mpi['error']}")
    else:
        lines += [
            f"MPI library         : {mpi.get('library_version')} (MPI {mpi.get('standard')})",
            f"mpi4py loaded       : {', '.join(mpi.get('loaded_libmpi', []))} "
            f"[abi {mpi.get('mpi4py_abi')}]",
            f"thread level        : {mpi.get('thread_level')}",
            f"mpiexec             : {mpiexec['path']} -> {mpiexec.get('resolves_to')}",
            f"mpiexec version     : {mpiexec['version']}",
            f"CUDA-aware (build)  : {mpi.get('cuda_built')}",
            f"CUDA-aware (runtime): {mpi.get('cuda_runtime')}",
        ]
    torch = rep.get("torch", {})
    lines.append(f"torch               : {torch.get('version', torch.get('error'))} "
                 f"cuda_available={torch.get('cuda_available')}")
    fast = rep.get("fastpath", {})
    lines.append(f"C small-message path: {fast.get('file')} built={fast.get('built')} "
                 f"loads={fast.get('loads')} enabled={fast.get('enabled')} "
                 f"node_round={fast.get('node_round')} (one-node jobs: header rounds in "
                 f"/dev/shm)"
                 if "error" not in fast else f"C small-message path: {fast['error']}")
    lines += _render_horovod(hvd)
    lines += [f"WARNING: {w}" for w in rep.get("warnings", [])]
    if rep.get("env"):
        lines.append("env (eval \"$(python3 mpi/mpi_select.py env " + sel.get("kind", "") + ")\"):")
        lines += [f"  {k}={v}" for k, v in sorted(rep["env"].items()) if k != "PATH"]
    return "\n".join(lines)


def _render_horovod(hvd: Report) -> list[str]:
    """Format the Horovod part of the report."""
    if not hvd.get("installed"):
        return [f"horovod             : {hvd.get('note')}"]
    lines = [f"horovod             : {hvd['version']} at {hvd['package_dir']}",
             f"horovod torch lib   : {hvd.get('torch_lib')}"]
    lines += [f"  ldd: {ln}" for ln in hvd.get("ldd_mpi", [])]
    lines.append(f"same libmpi as mpi4py: {hvd.get('libmpi_matches_mpi4py')}")
    lines.append("horovodrun --check-build:")
    lines += [f"  {ln}" for ln in hvd.get("check_build", "").splitlines() if ln.strip()]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the report (text or --json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mpi", default="auto", choices=mpi_select.KINDS + ("auto",))
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    rep = collect(args.mpi)
    print(json.dumps(rep, indent=2, default=str) if args.json else render(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
