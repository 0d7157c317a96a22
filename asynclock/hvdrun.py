"""`horovodrun` in this project's venv, working as Horovod's docs say.

The venv's bin/ holds MPICH's `mpirun` (the pip `mpich` wheel, the embedded
MPI), so with the venv active it comes first on PATH. Horovod's MPI
controller runs `mpirun --version`, recognises Open MPI, Spectrum MPI and
MPICH by their banners, and hydra's banner names none of them: horovodrun
stopped with "Unknown MPI implementation". The ranks would also need
`MPI4PY_LIBMPI` to load the same libmpi as Horovod.

So `mpi/build_horovod.py` installs a `horovodrun` into the venv that calls
`main()` here: for the MPI controller (anything but `--gloo`) it takes the
environment of the MPI Horovod was built for (`mpi_select.env_vars`: Open
MPI's shim dir first on PATH, `MPI4PY_LIBMPI`, the `OMPI_*` settings; the
build stamp in the venv says which MPI), then hands over to Horovod's own
entry point. horovodrun forwards that environment to every rank. `--gloo`
runs untouched: it starts the ranks itself and needs no MPI.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ._core.transports.horovod_mpi import STAMP_NAME


def horovod_kind(prefix: Path | None = None) -> str | None:
    """The MPI kind (`system`, `embedded`) the venv's Horovod was built for."""
    stamp = Path(sys.prefix if prefix is None else prefix) / STAMP_NAME
    try:
        kind = json.loads(stamp.read_text()).get("mpi_kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def controller_env(argv: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set before Horovod's horovodrun runs `argv` ({} for none).

    Only Open MPI's `mpirun` drives Horovod's MPI controller here, so only a
    Horovod built for the system Open MPI gets its environment.
    """
    if "--gloo" in argv or horovod_kind() != "system":
        return {}
    from ._tools import mpi_select

    if not mpi_select.available().get("system"):
        return {}
    return mpi_select.env_vars("system", environ)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry: set the controller's environment, then run Horovod's horovodrun."""
    args = list(sys.argv[1:] if argv is None else argv)
    os.environ.update(controller_env(args, os.environ))
    from horovod.runner.launch import run_commandline

    sys.argv[1:] = args
    run_commandline()
    return 0
