#!/usr/bin/env python3
"""CLI alias for mpi/mpi_select.py -- and a guard for the stdlib name `select`.

Why this file is tiny: `select` is a stdlib module (subprocess, selectors,
asyncio, trio, anyio import it).  Running `python mpi/select.py` puts mpi/ at
sys.path[0], and a test that puts mpi/ on sys.path would make every later
`import select` load *this* file.  So:

* run as a script: move mpi/ to the end of sys.path, then call mpi_select.main;
* imported under the name `select` by mistake: replace ourselves in
  sys.modules with the real stdlib module, so nothing else breaks;
* loaded by path under any other name (importlib.util.spec_from_file_location):
  re-export mpi_select's public API.

Import the real API as `mpi_select`, never as `select`.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _is_here(entry: str) -> bool:
    """True when a sys.path entry names this directory ('' means the cwd)."""
    return os.path.abspath(entry or os.curdir) == _HERE


def _demote_here() -> None:
    """Move this dir behind the stdlib on sys.path (keeps mpi_select importable)."""
    sys.path[:] = [p for p in sys.path if not _is_here(p)] + [_HERE]


def _become_stdlib_select() -> None:
    """Swap the real stdlib `select` into sys.modules in place of this file."""
    import importlib

    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if not _is_here(p)]
    del sys.modules["select"]
    try:
        real = importlib.import_module("select")
    finally:
        sys.path[:] = saved
    sys.modules["select"] = real
    globals().update({k: v for k, v in vars(real).items() if not k.startswith("__")})


def _reexport_api() -> None:
    """Loaded by path under another name: expose mpi_select's public API."""
    _demote_here()
    import mpi_select

    globals().update({k: v for k, v in vars(mpi_select).items() if not k.startswith("_")})


if __name__ == "select":
    _become_stdlib_select()
elif __name__ == "__main__":
    _demote_here()
    import mpi_select

    sys.exit(mpi_select.main())
else:
    _reexport_api()
