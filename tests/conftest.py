"""Shared pytest options: `--long` turns on the long fault/soak variants."""

from __future__ import annotations

import os
import resource
import time

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help="run long variants too")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long variant: run with --long")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """ASYNCLOCK_TEST_CPU_LOG=FILE: append each test's CPU seconds (this process and the
    jobs it waited for: MPI launchers count their ranks) and wall seconds to FILE, to find
    what makes the suite slow on CI's two cores."""
    log = os.environ.get("ASYNCLOCK_TEST_CPU_LOG")
    if not log:
        return (yield)
    before, began = _cpu_seconds(), time.perf_counter()
    try:
        return (yield)
    finally:
        with open(log, "a") as f:
            f.write(f"{_cpu_seconds() - before:.2f} {time.perf_counter() - began:.2f} "
                    f"{item.nodeid}\n")


def _cpu_seconds() -> float:
    own, waited = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                  resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime
