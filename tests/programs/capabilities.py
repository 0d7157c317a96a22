"""Horovod's capability queries, answered by Horovod 0.28.1 itself or by asynclock.torch.

Usage: capabilities.py [--horovod]   (under horovodrun, --gloo or not)

Each rank prints `CAPS <rank> <json>`: every query's answer (or the exception it
raised) before `init()` and after it. The test runs this under both libraries and
launchers and compares: the queries say what the job can do, as Horovod's do.
"""

from __future__ import annotations

import json
import sys
from typing import Any

if "--horovod" in sys.argv:
    import horovod.torch as hvd
else:
    import asynclock.torch as hvd  # type: ignore[no-redef]

QUERIES = ("mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
           "rocm_built", "mpi_enabled", "gloo_enabled", "mpi_threads_supported")


def answers() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in QUERIES:
        try:
            out[name] = getattr(hvd, name)()
        except Exception as exc:  # noqa: BLE001 - the answer is that it raises
            out[name] = f"raises {type(exc).__name__}"
    return out


def main() -> None:
    before = answers()
    hvd.init()
    rank, running = hvd.rank(), answers()
    print(f"CAPS {rank} " + json.dumps({"before": before, "running": running}), flush=True)
    hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()
