"""Shared pytest options: `--long` turns on the long fault/soak variants."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help="run long variants too")


# The files that take longest in CI (its `--durations`), started first: the parallel phase
# hands each worker whole files (`--dist loadfile --no-loadscope-reorder`, in this order),
# and a long file begun last keeps one worker busy while the other has nothing left.
LONGEST_FIRST = ("test_torch_mpi.py", "test_conformance.py", "test_netrig.py",
                 "test_collectives_mpi.py", "test_elastic.py", "test_horovod_parity.py",
                 "test_join_mpi.py", "test_checkpoint.py", "test_horovod.py",
                 "test_gpu_script.py", "test_bench_smoke.py", "test_error_recovery.py",
                 "test_adasum.py", "test_faults.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {name: n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: files stay whole
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long variant: run with --long")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
