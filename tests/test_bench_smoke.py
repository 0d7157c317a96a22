"""The collectives benchmark still runs and writes the JSON the issues quote (no timing
is asserted: speed lives in the benchmark's output, not in tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpijob import run_job

pytestmark = pytest.mark.mpi


def test_collectives_benchmark_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "collectives.json"
    job = run_job("../../bench/collectives.py", 2, "--sizes", "4,65536", "--rounds", "1",
                  "--round-seconds", "0.01", "--skip-idle", "--json", str(out), timeout=180,
                  env={"ASYNCLOCK_BENCH_HOROVOD": "0"})
    assert job.returncode == 0, job.explain()
    rows = json.loads(out.read_text())["rows"]
    for nbytes in (4, 65536):
        mine = {r["system"]: r for r in rows if r["bytes"] == nbytes}
        assert {"mpi4py", "asynclock"} <= set(mine), (nbytes, rows)
        assert mine["mpi4py"]["ratio_to_raw"] == 1.0
        assert all(r["seconds_median"] > 0 for r in mine.values()), rows
