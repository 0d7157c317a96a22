"""Through Horovod, as Horovod: what `import asynclock.torch as hvd` shows a Horovod
user under `horovodrun`, beside Horovod 0.28.1 itself.

- Capability queries (`gloo_built`, `mpi_enabled`, `nccl_built`, ...) answer what the
  job can do, as Horovod's: the same answers as Horovod's in the same kind of job,
  under `horovodrun --gloo` and under `horovodrun` with MPI (that one with --long).
- A synthetic-benchmark-like loop under `horovodrun --gloo`, long enough that unique
  names would overflow Horovod's 1024-entry response cache, prints no Horovod warning,
  and Horovod answers its gradient buckets from the cache (its own timeline says so);
  asynclock started Horovod with its defaults (5 ms cycle, group fusion off). Buckets
  go through Horovod where ranks span hosts; on one node they take a shared-memory
  file after the profiling round, so the loop runs both ways.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from mpijob import Job, assert_labels, horovod_status, horovodrun_missing, run_horovodrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from hvd_synthetic import (  # noqa: E402
    WARNING,
    cache_rate,
    negotiations_by_name,
    tensor_names,
)


def need(gloo: bool) -> None:
    why = horovod_status()[1] or horovodrun_missing(gloo)
    if why:
        pytest.skip(why)


def caps(job: Job) -> dict[int, dict[str, dict[str, object]]]:
    assert job.returncode == 0, job.explain()
    # A document is read up to its own end: under load another rank's output can run on
    # in the same line of the launcher's merged stream.
    decode = json.JSONDecoder().raw_decode
    found = {int(m[1]): decode(job.output, m.end())[0]
             for m in re.finditer(r"CAPS (\d+) (?=\{)", job.output)}
    assert set(found) == {0, 1}, job.explain()
    return found


@pytest.mark.mpi
@pytest.mark.horovod
@pytest.mark.parametrize("gloo", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["gloo", "mpi"])
def test_capability_queries_answer_as_horovods_do(gloo: bool) -> None:
    need(gloo)
    theirs = caps(run_horovodrun("capabilities.py", 2, "--horovod", gloo=gloo, timeout=150))
    ours = caps(run_horovodrun("capabilities.py", 2, gloo=gloo, timeout=150))
    assert ours == theirs, f"asynclock: {ours[0]}\nhorovod:   {theirs[0]}"
    running = ours[0]["running"]
    assert running["gloo_enabled"] is gloo and running["mpi_enabled"] is not gloo, running
    assert running["gloo_built"] is True and running["mpi_built"] is True, running
    assert running["nccl_built"] == 0, running  # CPU ranks: no NCCL path


@pytest.mark.horovod
def test_synthetic_loop_under_horovodrun_gloo_fills_no_cache_and_warns_nothing(
        tmp_path: Path) -> None:
    """40 steps of a 64-tensor model, fp32 and fp16, with a named and an unnamed metric
    allreduce a step: per-step names would pass 1024 entries about half-way and make
    Horovod print its eviction warning on every rank."""
    need(gloo=True)
    timeline = tmp_path / "timeline.json"
    # the shared-memory window off: buckets through Horovod, as across hosts
    job = run_horovodrun("hvd_synthetic_loop.py", 2, "--steps", "40", gloo=True, timeout=300,
                         env={"HOROVOD_TIMELINE": str(timeline),
                              "ASYNCLOCK_NODE_WINDOW": "0"})
    assert_labels(job, 2, "fp32", "fp16")
    assert not WARNING.findall(job.output), job.explain()
    assert not re.search(r"\bW \S*horovod", job.output), job.explain()
    rate = cache_rate(timeline)
    # 64 gradients a step in fp32 (fp16 buckets go whole) and 2 metrics: what misses is
    # each name's first use (a bucket's, a metric slot's, the final allgather).
    assert rate["negotiations"] >= 40 * 64, rate
    assert rate["hit_rate"] >= 0.93, rate
    # the fp32 model's one bucket of 64 gradients keeps its names through the re-plan
    # after the profiling round, which keeps the bucket: 64 names, not 64 per plan
    grads = [n for n in tensor_names(timeline) if ".grad." in n and "grouped" in n]
    assert len(grads) == 64, sorted(grads)
    # asynclock started Horovod with its own cycle time and group fusion off (nothing
    # set by the user here), on every rank
    settings = set(re.findall(r"HVD_SETTINGS (\d+) (.*)", job.output))
    assert settings == {(str(r), "cycle=5 group_fusion_off=1") for r in (0, 1)}, job.explain()


@pytest.mark.horovod
def test_synthetic_loop_on_one_node_takes_buckets_off_horovod(tmp_path: Path) -> None:
    """On one node under `horovodrun --gloo` there is no MPI window, and buckets go
    through a mapped /dev/shm file after the profiling round: Horovod negotiates each
    gradient bucket once per optimizer (the profiling round) and prints nothing; the
    file is gone once the ranks mapped it."""
    need(gloo=True)
    timeline = tmp_path / "timeline.json"
    before = set(Path("/dev/shm").glob("asynclock-grads-*"))
    job = run_horovodrun("hvd_synthetic_loop.py", 2, "--steps", "12", gloo=True, timeout=300,
                         env={"HOROVOD_TIMELINE": str(timeline)})
    assert_labels(job, 2, "fp32", "fp16")
    assert not WARNING.findall(job.output), job.explain()
    assert not re.search(r"\bW \S*horovod", job.output), job.explain()
    counts = negotiations_by_name(timeline)
    grads = {n: c for n, c in counts.items() if ".grad." in n}
    assert grads and max(grads.values()) <= 2, grads  # the fp32 and fp16 profiling rounds
    assert set(Path("/dev/shm").glob("asynclock-grads-*")) <= before
