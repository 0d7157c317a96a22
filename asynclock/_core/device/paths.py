"""Which path CUDA tensors take: device buffers straight to MPI, or host staging.

Detection, cached per process (ASYNCLOCK_CUDA_DIRECT=0|1 overrides):

1. `MPIX_Query_cuda_support()` / MPICH's `MPIX_GPU_query_support(CUDA)`,
   looked up in the libmpi that mpi4py loaded (`MPI.Query_cuda_support`
   when a newer mpi4py exposes it);
2. Open MPI without the extension: `ompi_info --parsable --all` reporting
   `mpi_built_with_cuda_support:value:true`;
3. MPICH: `MPIR_CVAR_ENABLE_GPU=0` in the environment turns GPU support off.

Being CUDA-aware is not enough for asynclock, which only issues
*non-blocking* collectives: Open MPI 4.x supports device pointers in
point-to-point and blocking collectives only ("neither the nonblocking
collective APIs ..." — Open MPI CUDA FAQ), and 5.x stages reductions itself.
So device buffers go to MPI directly only on MPICH-family libraries with
GPU support (yaksa handles non-blocking collectives on device memory), or
when forced with ASYNCLOCK_CUDA_DIRECT=1; everything else is staged through
pinned host buffers on asynclock's copy streams (`engine.staging`).

Horovod: when Horovod was built with GPU operations (`hvd.nccl_built()`,
`hvd.cuda_built()`), its own `allreduce_async_` on CUDA tensors runs NCCL on
Horovod's streams and is the faster path for the Horovod backend; asynclock
only reports it here. Staging works with any Horovod build.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from ..base import settings
from ..transports.process_group import chosen_device_path

_MPIX_GPU_SUPPORT_CUDA = 0


@dataclass(frozen=True, slots=True)
class CudaSupport:
    """What the MPI library says about device buffers, and what asynclock does about it.

    Attributes:
        library: "mpich", "openmpi", "other" or "none".
        cuda_aware: whether the library accepts device pointers at all.
        direct: whether asynclock passes device buffers to its collectives.
        how: how this was decided, for logs and `describe()`.
    """

    library: str
    cuda_aware: bool
    direct: bool
    how: str


def _mpi() -> Any:
    """mpi4py's MPI if it is up; never imported here (importing it initialises MPI)."""
    MPI = sys.modules.get("mpi4py.MPI")  # noqa: N806
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    return MPI


def _library(MPI: Any) -> str:  # noqa: N803 - the module's own name
    text = MPI.Get_library_version()
    if "Open MPI" in text:
        return "openmpi"
    if any(k in text for k in ("MPICH", "Intel(R) MPI", "MVAPICH", "CRAY MPICH")):
        return "mpich"
    return "other"


def libmpi_paths() -> list[str]:
    """libmpi shared objects mapped into this process (mpi4py loads them locally)."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "/libmpi" in line})
    except OSError:
        return []


def _query_symbols() -> bool | None:
    """Ask the loaded libmpi through its MPIX query functions, if it has them."""
    for path in libmpi_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "MPIX_GPU_query_support"):
            flag = ctypes.c_int(0)
            if lib.MPIX_GPU_query_support(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
                return bool(flag.value)
        if hasattr(lib, "MPIX_Query_cuda_support"):
            lib.MPIX_Query_cuda_support.restype = ctypes.c_int
            return bool(lib.MPIX_Query_cuda_support())
    return None


def ompi_info_says_cuda(timeout: float = 20.0) -> bool | None:
    """Open MPI's build flag via `ompi_info`; None when ompi_info is unavailable."""
    exe = shutil.which("ompi_info")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--parsable", "--all"], capture_output=True, text=True,
                             timeout=timeout, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "mpi_built_with_cuda_support:value:true" in out


def _aware(MPI: Any, library: str) -> tuple[bool, str]:
    query = getattr(MPI, "Query_cuda_support", None)
    if callable(query):
        return bool(query()), "mpi4py MPI.Query_cuda_support()"
    if library == "mpich" and os.environ.get("MPIR_CVAR_ENABLE_GPU", "1") == "0":
        return False, "MPIR_CVAR_ENABLE_GPU=0"
    found = _query_symbols()
    if found is not None:
        return found, "MPIX query in libmpi"
    if library == "openmpi":
        info = ompi_info_says_cuda()
        if info is not None:
            return info, "ompi_info mpi_built_with_cuda_support"
    return False, "no CUDA query available"


_DETECTED: CudaSupport | None = None


def cuda_support() -> CudaSupport:
    """How this process's MPI handles device buffers; detected once per process.

    Returns:
        The answer; before MPI is initialised, library "none" (not cached).
    """
    global _DETECTED
    if _DETECTED is None:
        MPI = _mpi()  # noqa: N806
        if MPI is None:
            return CudaSupport("none", False, False, "MPI is not initialised")
        _DETECTED = _detect(MPI)
    return _DETECTED


def _detect(MPI: Any) -> CudaSupport:  # noqa: N803
    library = _library(MPI)
    aware, how = _aware(MPI, library)
    forced = settings.text("ASYNCLOCK_CUDA_DIRECT")
    if forced in ("0", "1"):
        return CudaSupport(library, aware, forced == "1", f"{how}; ASYNCLOCK_CUDA_DIRECT={forced}")
    return CudaSupport(library, aware, aware and library == "mpich", how)


def horovod_gpu() -> str | None:
    """'nccl', 'cuda' or None: Horovod's GPU operations, if Horovod is loaded.

    Only inspects an already imported `horovod.torch` (importing Horovod
    initialises its library), so this costs nothing otherwise.

    Returns:
        "nccl", "cuda", or None where Horovod is not loaded or has no GPU
        operations.
    """
    hvd = sys.modules.get("horovod.torch")
    if hvd is None:
        return None
    if hvd.nccl_built():
        return "nccl"
    return "cuda" if hvd.cuda_built() else None


def describe() -> str:
    """One line for logs: how CUDA tensors travel in this process, and why.

    Returns:
        A line naming the path CUDA tensors take, the MPI library and why.
    """
    s = cuda_support()
    chosen = chosen_device_path()
    if chosen is not None and chosen.backend is not None:
        path = f"{chosen.path} through a private process group ({chosen.reason})"
    else:
        path = "device buffers to MPI" if s.direct else "host staging (pinned, copy streams)"
        if chosen is not None:
            path += f" ({chosen.reason})"
    hvd = horovod_gpu()
    extra = f"; horovod GPU ops: {hvd}" if hvd else ""
    return f"cuda transport: {path} [{s.library}, cuda_aware={s.cuda_aware}: {s.how}]{extra}"
