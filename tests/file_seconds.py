"""The order in which launch/test.sh's two pytest workers take test files.

Each worker takes whole files (`--dist loadfile`: a file's tests share its cached
jobs), the next one in line as it finishes one. xdist's own order, most tests first,
leaves the files with few but long tests (whole Horovod suites, netrig clusters) for
the end, where one worker may run one of them alone while the other has nothing left.
Longest first (`file_seconds.json`: each file's wall seconds in one run) makes the two
workers end close together. A file not in the table goes after the known ones.

Regenerate the table from a run with `ASYNCLOCK_TEST_CPU_LOG=FILE` (tests/conftest.py):

    python tests/file_seconds.py FILE > tests/file_seconds.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

TABLE = Path(__file__).with_name("file_seconds.json")


def load() -> dict[str, float]:
    """File path (as in a test's node id) -> seconds; empty without the table."""
    try:
        table: dict[str, float] = json.loads(TABLE.read_text())
    except FileNotFoundError:
        return {}
    return table


def order_key(table: dict[str, float]) -> Callable[[str], float]:
    """A sort key for node ids: longest file first, unknown files last (stable)."""
    def key(nodeid: str) -> float:
        return -table.get(nodeid.split("::", 1)[0], 0.0)
    return key


def from_log(lines: list[str]) -> dict[str, float]:
    """Per-file wall seconds from ASYNCLOCK_TEST_CPU_LOG lines ("cpu wall nodeid")."""
    seconds: dict[str, float] = defaultdict(float)
    for line in lines:
        _cpu, wall, nodeid = line.split(" ", 2)
        seconds[nodeid.split("::", 1)[0]] += float(wall)
    return {f: round(s, 1) for f, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    print(json.dumps(from_log(Path(sys.argv[1]).read_text().splitlines()), indent=1))
