#!/usr/bin/env python3
"""The MPI kit's selector: which MPI the project runs on, and how to run it.

The code is the package's, `asynclock/_tools/mpi_select.py` (see there), so that
the launcher has it from an installed wheel too. This file is its face in the
repository's kit, for any python3 (the system's too, without the venv):

    eval "$(python3 mpi/mpi_select.py env [embedded|system|auto])"
    $(python3 mpi/mpi_select.py launcher [kind] -n 3) python script.py
    python3 mpi/mpi_select.py info [kind|all]          # JSON
    python3 mpi/mpi_select.py describe [kind]          # one line

and, with mpi/ on sys.path, `import mpi_select` gives the package module's API.
It loads that module by path, not by `import asynclock._tools.mpi_select`: the
package's `__init__` needs anyio, numpy and mpi4py, which a bare python3 lacks.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SOURCE = Path(__file__).resolve().parents[1] / "asynclock" / "_tools" / "mpi_select.py"


def _load() -> object:
    spec = importlib.util.spec_from_file_location("mpi_select", _SOURCE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {_SOURCE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    sys.exit(_load().main())  # type: ignore[attr-defined]
else:
    # `import mpi_select` returns what sys.modules holds once this file has run: the
    # package module's code under this name, one module for every importer.
    sys.modules[__name__] = _load()  # type: ignore[assignment]
