"""One rank of a conformance job: pytest over Horovod's test files, as Horovod's
CI runs them (`mpirun -np N python -m pytest ...`), with a JUnit file per rank.

    rank_pytest.py OUTDIR TIMEOUT FILE...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "HOROVOD_RANK")


def world_rank() -> int:
    for var in _RANK_VARS:
        if var in os.environ:
            return int(os.environ[var])
    return 0


def main(argv: list[str]) -> int:
    out, timeout, files = Path(argv[0]), argv[1], argv[2:]
    rank = world_rank()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # for -p hvd_alias
    os.environ["ASYNCLOCK_CONFORMANCE_LOG"] = str(out / f"rank{rank}.jsonl")
    method = os.environ.get("ASYNCLOCK_CONFORMANCE_TIMEOUT_METHOD", "signal")
    args = ["-q", "-p", "no:cacheprovider", "-p", "hvd_alias", f"--timeout={timeout}",
            f"--timeout-method={method}", f"--junitxml={out / f'rank{rank}.xml'}",
            "-o", "junit_family=xunit1", *files]
    select = os.environ.get("ASYNCLOCK_CONFORMANCE_SELECT")
    if select:
        args += ["-k", select]
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
