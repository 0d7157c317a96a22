"""Which MPI Horovod was built for, and whether this rank's launcher and mpi4py match it.

Horovod links one libmpi when it is built. Started by another MPI's launcher
(Open MPI's Horovod under MPICH's `mpiexec`, say), its MPI_Init finds none
of that launcher's wiring and every rank becomes a world of size 1: N
independent jobs, each training alone, with nothing but a RuntimeWarning
from mpi4py. So the Horovod backend checks before it initializes anything
and refuses such a start with an error naming both MPIs.

Horovod's MPI is read from its own extension (the libmpi soname it links);
the build stamp `mpi/build_horovod.py` writes into the venv
(`asynclock-horovod-key.json`) adds version and path to the message. The
launcher is known by the variables it gives each rank: Open MPI's `mpirun`
sets `OMPI_COMM_WORLD_SIZE`, MPICH's hydra `PMI_SIZE` with its PMI socket.
Anything else (Slurm's `srun`, no launcher) is not judged here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..base.errors import BackendError

STAMP_NAME = "asynclock-horovod-key.json"
# the libmpi sonames of the two MPI ABIs a Horovod build links
_SONAMES = {b"libmpi.so.40": "Open MPI", b"libmpi.so.12": "MPICH"}
_HYDRA_VARS = ("HYDI_CONTROL_FD", "PMI_FD", "PMI_PORT")


@dataclass(frozen=True)
class MPIName:
    """An MPI by vendor, with what names it in a message."""

    vendor: str
    detail: str

    def __str__(self) -> str:
        return f"{self.vendor} ({self.detail})"


def vendor_of(library_version: str) -> str | None:
    """`Open MPI` or `MPICH` from `MPI_Get_library_version`; None for any other."""
    if library_version.startswith("Open MPI"):
        return "Open MPI"
    return "MPICH" if library_version.startswith("MPICH") else None


def horovod_mpi(package_dir: Path, prefix: Path | None = None) -> MPIName | None:
    """The MPI the Horovod in `package_dir` links; None when it links none we know."""
    vendor, soname = None, ""
    for lib in sorted(package_dir.glob("torch/mpi_lib*.so")):
        data = lib.read_bytes()
        for name, who in _SONAMES.items():
            if name + b"\0" in data:
                vendor, soname = who, name.decode()
    if vendor is None:
        return None
    stamp = Path(sys.prefix if prefix is None else prefix) / STAMP_NAME
    try:
        key = json.loads(stamp.read_text())
    except (OSError, ValueError):
        key = {}
    if isinstance(key, dict) and key.get("mpi_vendor") == vendor:
        version = str(key.get("mpi_version", vendor)).split(",")[0]
        return MPIName(vendor, f"{version}, {key.get('libmpi', soname)}, as {stamp} records")
    return MPIName(vendor, f"its extension links {soname}")


def launcher_mpi(env: Mapping[str, str]) -> MPIName | None:
    """The MPI whose launcher started this rank, when its variables say so."""
    if "OMPI_COMM_WORLD_SIZE" in env:
        return MPIName("Open MPI", f"mpirun, OMPI_COMM_WORLD_SIZE={env['OMPI_COMM_WORLD_SIZE']}")
    if "PMI_SIZE" in env and any(v in env for v in _HYDRA_VARS) and "SLURM_JOB_ID" not in env:
        return MPIName("MPICH", f"hydra's mpiexec, PMI_SIZE={env['PMI_SIZE']}")
    return None


def check_launcher(built: MPIName | None, env: Mapping[str, str]) -> None:
    """Refuse a rank started by another MPI's launcher than Horovod's."""
    started = launcher_mpi(env)
    if built is None or started is None or started.vendor == built.vendor:
        return
    raise BackendError(
        f"the Horovod backend cannot run here: Horovod is built for {built}, but this rank "
        f"was started by {started}; every rank would be a world of size 1. Launch with "
        f"{built.vendor}'s launcher (python -m asynclock.launch --mpi "
        f"{'system' if built.vendor == 'Open MPI' else 'embedded'}), rebuild Horovod for "
        f"{started.vendor} (mpi/build_horovod.py), or use backend='mpi'")


def check_mpi4py(built: MPIName | None, library_version: str) -> None:
    """Refuse two MPI libraries in one process: mpi4py's and Horovod's."""
    loaded = vendor_of(library_version)
    if built is None or loaded is None or loaded == built.vendor:
        return
    raise BackendError(
        f"the Horovod backend cannot run here: Horovod is built for {built}, but mpi4py "
        f"loaded {library_version.splitlines()[0].strip()}; the two cannot share a world. "
        f"Set MPI4PY_LIBMPI to {built.vendor}'s libmpi (mpi/mpi_select.py env) or use "
        f"backend='mpi'")
