"""Shared pytest options: `--long` turns on the long fault/soak variants."""

from __future__ import annotations

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
