"""The collectives benchmark still runs and writes the JSON the issues quote (no timing
is asserted: speed lives in the benchmark's output, not in tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpijob import DEFAULT_KIND, horovod_status, run_job

pytestmark = pytest.mark.mpi


def test_collectives_benchmark_writes_its_figures(tmp_path: Path) -> None:
    """Where Horovod is built for this MPI, its rows come from a second pass with raw
    MPI timed beside it, every ratio still to raw MPI's figure from the first pass."""
    out = tmp_path / "collectives.json"
    job = run_job("../../bench/collectives.py", 2, "--sizes", "4,65536", "--rounds", "1",
                  "--round-seconds", "0.01", "--skip-idle", "--json", str(out), timeout=180)
    assert job.returncode == 0, job.explain()
    rows = json.loads(out.read_text())["rows"]
    for nbytes in (4, 65536):
        mine = {r["system"]: r for r in rows if r["bytes"] == nbytes}
        assert {"mpi4py", "asynclock"} <= set(mine), (nbytes, rows)
        assert mine["mpi4py"]["ratio_to_raw"] == 1.0
        assert all(r["seconds_median"] > 0 for r in mine.values()), rows
        if "horovod" in mine:
            beside = mine["mpi4py-beside-horovod"]
            assert beside["ratio_to_raw"] == pytest.approx(
                beside["seconds_median"] / mine["mpi4py"]["seconds_median"]), rows
    kind, why = horovod_status()
    if not why and kind == DEFAULT_KIND:
        assert any(r["system"] == "horovod" for r in rows), job.explain()


@pytest.mark.slow
def test_training_benchmark_runs_horovod_only_in_its_own_windows(tmp_path: Path) -> None:
    """bench/train.py shuts Horovod down between its windows (its idle background
    thread spins on the cores the other methods train on) and starts it again for
    each of them: the job must get through several such cycles with Horovod's
    DistributedOptimizer and a gated asynclock method side by side, and write
    a figure for each method."""
    from mpijob import horovod_status

    kind, why = horovod_status()
    if why:
        pytest.skip(why)
    out = tmp_path / "train.json"
    job = run_job("../../bench/train.py", 2, "--models", "mlp",
                  "--methods", "compute,horovod,asynclock-gated", "--windows", "3",
                  "--steps", "2", "--warmup", "1", "--json", str(out), timeout=240, kind=kind)
    assert job.returncode == 0, job.explain()
    written = json.loads(out.read_text())
    figures = written["samples_per_s"]["mlp"]
    assert set(figures) == {"compute", "horovod", "asynclock-gated"}, figures
    assert all(v > 0 for v in figures.values()), figures
    r = written["ratios"]["mlp"]
    assert (r["best_asynclock"], r["best_peer"]) == ("asynclock-gated", "horovod"), r
    assert r["vs_best_peer"] == figures["asynclock-gated"] / figures["horovod"], r
    assert r["vs_compute"] == figures["asynclock-gated"] / figures["compute"], r
    assert "best asynclock: asynclock-gated, " in job.output, job.explain()


def test_training_benchmark_table_runs_sharded_methods_and_bounds(tmp_path: Path) -> None:
    """One job of the training table: the sharded rows (Horovod API plain and gated,
    async API) run past the switch into the window and each writes a figure; and
    bound-comm and bound-overlap (the gradient bytes' allreduce alone, and beside
    backward from its first moment) are reported against the best peer, while neither
    may stand in as the best peer or the best asynclock method (bound-comm, which does
    no compute, is faster than every real method)."""
    out = tmp_path / "train.json"
    sharded = ["asynclock-sharded", "asynclock-sharded-gated", "asynclock-async-sharded"]
    methods = ["compute", "ddp", "asynclock", *sharded, "bound-comm", "bound-overlap"]
    job = run_job("../../bench/train.py", 2, "--models", "mlp", "--methods", ",".join(methods),
                  "--windows", "2", "--steps", "2", "--warmup", "2", "--json", str(out),
                  timeout=240)
    assert job.returncode == 0, job.explain()
    written = json.loads(out.read_text())
    figures = written["samples_per_s"]["mlp"]
    assert set(figures) == set(methods), figures
    assert all(v > 0 for v in figures.values()), figures
    r = written["ratios"]["mlp"]
    best = r["best_asynclock"]
    assert best in ("asynclock", *sharded) and r["best_peer"] == "ddp", r
    assert r["vs_best_peer"] == figures[best] / figures["ddp"], r
    assert r["overlap_bound_vs_best_peer"] == figures["bound-overlap"] / figures["ddp"], r
    assert "overlap bound " in job.output, job.explain()
    cpu = written["cpu_ms_per_step"]["mlp"]
    assert r["best_cpu_vs_ddp"] == cpu[best] / cpu["ddp"], r
    assert set(r["cpu_vs_ddp"]) == {"asynclock", *sharded}, r  # asynclock methods, no bounds
    assert "asynclock CPU per step / DDP's: " in job.output, job.explain()


def test_the_rig_table_prints_asynclock_cpu_per_step_over_ddps() -> None:
    """Issue 37: the rig's table says how asynclock's CPU per step compares with DDP's,
    for the best asynclock method of each column (not the lightest one)."""
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))  # its `timing` module
    spec = importlib.util.spec_from_file_location("netrig_bench", bench / "netrig.py")
    assert spec is not None and spec.loader is not None
    netrig = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = netrig  # its dataclasses look their module up there
    spec.loader.exec_module(netrig)

    def row(mpi: str, method: str, rate: float, cpu: float) -> dict[str, object]:
        return {"link": "5gbit", "mpi": mpi, "model": "mlp", "method": method,
                "samples_per_s": rate, "cpu_ms_per_step": cpu, "params": 1000, "batch": 32}

    rows = [row("mpich", "ddp", 250.0, 80.0), row("mpich", "asynclock", 240.0, 60.0),
            row("mpich", "asynclock-bucket", 260.0, 96.0), row("openmpi", "ddp", 250.0, 80.0)]
    line = next(ln for ln in netrig.render_train(rows).splitlines() if "cpu/step vs ddp" in ln)
    assert line.split()[-2:] == ["1.20x", "-"], line
