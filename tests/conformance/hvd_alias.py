"""pytest plugin: `import horovod.torch` resolves to `asynclock.torch`.

Loaded with `-p hvd_alias` before Horovod's test files are imported. The rest
of the `horovod` package stays the real one (their helper module imports
`horovod.runner`). With ASYNCLOCK_CONFORMANCE_TARGET=horovod it does nothing,
so the same command runs the suite against real Horovod.
"""

from __future__ import annotations

import os
import sys


def _alias() -> None:
    import horovod  # the real package: its runner helpers stay importable

    import asynclock.torch
    import asynclock.torch._hvd.mpi_ops

    sys.modules["horovod.torch"] = asynclock.torch
    sys.modules["horovod.torch.mpi_ops"] = asynclock.torch._hvd.mpi_ops
    horovod.torch = asynclock.torch  # type: ignore[attr-defined]


if os.environ.get("ASYNCLOCK_CONFORMANCE_TARGET", "asynclock") == "asynclock":
    _alias()


_LOG = os.environ.get("ASYNCLOCK_CONFORMANCE_LOG")  # a JSONL file per rank, appended per test


def pytest_runtest_logreport(report: object) -> None:
    """Write each test's outcome as it happens: a job killed by its timeout still
    leaves what ran (a JUnit file is only written at the end)."""
    if not _LOG:
        return
    import json

    when, outcome = report.when, report.outcome
    if when != "call" and outcome == "passed":
        return  # setup/teardown that passed says nothing
    name = str(report.nodeid).rsplit("::", 1)[-1]
    detail = ""
    if outcome == "failed":
        detail = str(getattr(report, "longreprtext", ""))[-600:]
    with open(_LOG, "a") as f:
        f.write(json.dumps({"test": name, "when": when, "outcome": outcome,
                            "detail": detail}) + "\n")
        f.flush()


def pytest_collection_modifyitems(config: object, items: list[object]) -> None:
    """ASYNCLOCK_CONFORMANCE_FROM=NAME: run NAME and the tests after it only (a
    reference taken in two jobs around a test where real Horovod hangs).
    ASYNCLOCK_CONFORMANCE_SHORT="NAME ... SECONDS": those tests get a per-test timeout
    of their own (tests that take seconds, and whose failing rank leaves the others
    waiting in the test's last barrier until the timeout)."""
    _shorten(items, os.environ.get("ASYNCLOCK_CONFORMANCE_SHORT", "").split())
    start = os.environ.get("ASYNCLOCK_CONFORMANCE_FROM")
    if not start:
        return
    names = [str(getattr(item, "name", "")) for item in items]
    if start in names:
        del items[:names.index(start)]


def _shorten(items: list[object], spec: list[str]) -> None:
    if len(spec) < 2:
        return
    import pytest

    *names, seconds = spec
    for item in items:
        if getattr(item, "name", "") in names:
            item.add_marker(pytest.mark.timeout(float(seconds)))  # type: ignore[attr-defined]
