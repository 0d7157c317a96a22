"""Measuring for bench/cost_model.py (`--measure local|netrig|machine`): it launches
the rank program (`cost_probe`) on each MPI and layout, here or across netrig hosts,
repeats each job and keeps every run, times one core's memory, and writes it all to
bench/cost_params.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from cost_formulas import SIZES
from timing import median, per_call

ROOT = Path(__file__).resolve().parents[1]
PARAMS_JSON = ROOT / "bench" / "cost_params.json"
COMMAND = Path(__file__).resolve().with_name("cost_model.py")  # its `probe` mode


@dataclass
class Job:
    """One probe launch: an MPI, N ranks at `ppn` per host, a label."""

    mpi: str  # embedded (MPICH) or system (Open MPI)
    n: int
    ppn: int
    where: str  # local or netrig
    horovod: bool = False
    sizes: tuple[int, ...] = SIZES[:3]
    p2p: bool = False
    repeat: int = 0  # runs of this job (0: --repeat)
    env: dict[str, str] = field(default_factory=dict)


def probe_argv(job: Job, out: Path, args: argparse.Namespace, link: str) -> list[str]:
    argv = [sys.executable, str(COMMAND), "probe", "--json", str(out),
            "--sizes", ",".join(map(str, job.sizes)), "--link", link,
            "--rounds", str(args.rounds), "--round-s", str(args.round_s)]
    return argv + (["--horovod"] if job.horovod else []) + (["--p2p"] if job.p2p else [])


# asynclock's bulk allreduces on MPI only (no gloo probe), and no heartbeat thread
PROBE_ENV = {"ASYNCLOCK_BULK": "mpi", "ASYNCLOCK_BENCH_HOROVOD": "0", "OMP_NUM_THREADS": "1"}


def cpu_idle(seconds: float = 1.0) -> float:
    """The fraction of the machine's CPU time left idle over `seconds` (/proc/stat)."""
    def snap() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    idle0, all0 = snap()
    time.sleep(seconds)
    idle1, all1 = snap()
    return (idle1 - idle0) / max(1, all1 - all0)


def wait_quiet(max_s: float, want: float = 0.85) -> float:
    """Start a job once other work on the machine has (mostly) stopped, or after
    `max_s`: the cores are shared, and a job beside a busy process measures it."""
    deadline = time.monotonic() + max_s
    while True:
        idle = cpu_idle()
        if idle >= want or time.monotonic() > deadline:
            return idle
        time.sleep(2.0)


def run_local(job: Job, args: argparse.Namespace) -> dict[str, Any] | None:
    sys.path.insert(0, str(ROOT / "mpi"))
    import mpi_select

    with tempfile.TemporaryDirectory(prefix="cost-model-") as tmp:
        out = Path(tmp) / "out.json"
        env = {**mpi_select.environ_for(job.mpi), **PROBE_ENV, **job.env}
        argv = mpi_select.launcher(job.mpi, job.n) + probe_argv(job, out, args, "local")
        idle = wait_quiet(args.quiet_s)
        t0 = time.monotonic()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=args.job_timeout, check=False)
        print(f"#   {time.monotonic() - t0:.0f} s, {idle:.0%} idle before", flush=True)
        return _finish(proc, out, job, idle)


def _finish(proc: subprocess.CompletedProcess[str], out: Path, job: Job,
            idle: float) -> dict[str, Any] | None:
    label = f"{job.where} {job.mpi} n={job.n} ppn={job.ppn}{' horovod' if job.horovod else ''}"
    print(f"# {label}: exit {proc.returncode}", flush=True)
    if proc.returncode != 0 or not out.exists():
        print((proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
        return None
    data: dict[str, Any] = json.loads(out.read_text())
    data["meta"].update(kind=job.mpi, where=job.where, horovod=job.horovod, idle=[idle])
    return data


def local_jobs(args: argparse.Namespace) -> Iterator[Job]:
    for mpi in args.mpis.split(","):
        for n in (1, 2, 4, 8):
            sizes = SIZES if n <= 2 else SIZES[:3]
            # the points the parameters come from get more runs
            yield Job(mpi, n, n, "local", sizes=sizes, p2p=n == 2, repeat=5 if n <= 2 else 0)
        if mpi == "system" and not args.skip_horovod:
            for n in (2, 4):
                yield Job(mpi, n, n, "local", horovod=True)


def netrig_jobs(args: argparse.Namespace) -> Iterator[Job]:
    for mpi in args.mpis.split(","):
        yield Job(mpi, 2, 1, "netrig", sizes=SIZES, p2p=True, repeat=5)
        yield Job(mpi, 4, 2, "netrig", p2p=True)
        if mpi == "system" and not args.skip_horovod:
            yield Job(mpi, 2, 1, "netrig", horovod=True)


def measure_netrig(args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "tests" / "programs"))
    import netrig_rig

    reason = netrig_rig.unavailable()
    if reason is not None:
        raise SystemExit(f"netrig: {reason}")
    found = []
    with netrig_rig.Rig() as rig:
        rig.up(2)
        rig.rate(args.link)
        for job in netrig_jobs(args):
            data = repeated(partial(run_rig, rig=rig, args=args), job, args.repeat)
            if data is not None:
                found.append(data)
    return found


def run_rig(job: Job, rig: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory(prefix="cost-model-") as tmp:
        out = Path(tmp) / "out.json"
        idle = wait_quiet(args.quiet_s)
        live = rig.start(job.mpi, job.n, probe_argv(job, out, args, args.link),
                         {**PROBE_ENV, **job.env}, per_host=job.ppn)
        code = live.finish(args.job_timeout)
        data = _finish(subprocess.CompletedProcess([], code, live.output, ""), out, job, idle)
    rig.reap()
    return data


MEM_SIZES = (64 << 10, 512 << 10, 4 << 20, 64 << 20)


def machine_rows() -> list[dict[str, Any]]:
    """One core's memcpy and float32 sum by working-set size, best of 5 batches; and
    what memory the process has not touched yet costs (page faults, zeroing)."""
    import numpy as np
    import torch

    big = 64 << 20
    warm = torch.empty(big // 4)
    fresh = min(per_call(lambda: torch.empty(big // 4).fill_(1.0), 1) for _ in range(5))
    refill = min(per_call(lambda: warm.fill_(1.0), 1) for _ in range(5))
    rows = [{"kind": "fresh_memory", "bytes": big, "seconds": fresh - refill}]
    # one core's copy and sum, the best of 5 batches: the machine, not its other users
    for nbytes in MEM_SIZES:
        a = np.ones(nbytes // 4, np.float32)
        b = np.ones(nbytes // 4, np.float32)
        reps = max(1, (64 << 20) // nbytes)
        for kind, fn in (("memcpy", partial(np.copyto, b, a)),
                         ("sum_f32", partial(np.add, a, b, out=b))):
            fn()
            per = min(per_call(fn, reps) for _ in range(5))
            rows.append({"kind": kind, "bytes": nbytes, "seconds": per})
    return rows + concurrent_rows()


def concurrent_rows() -> list[dict[str, Any]]:
    """The same copy and sum on every core at once (numpy releases the GIL): what each
    of a node's ranks gets while they all copy, as in the node window."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    cores = os.cpu_count() or 1
    rows = []
    for nbytes in MEM_SIZES:
        pairs = [(np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32))
                 for _ in range(cores)]
        reps = max(1, (64 << 20) // nbytes)
        for kind, op in (("memcpy_all_cores", np.copyto), ("sum_f32_all_cores", _add_into)):
            with ThreadPoolExecutor(cores) as pool:
                batch = partial(_on_every_core, pool, op, pairs, reps)
                batch()
                per = min(per_call(batch, 1) for _ in range(5)) / reps
            rows.append({"kind": kind, "bytes": nbytes, "seconds": per, "cores": cores})
    return rows


def _add_into(dst: Any, src: Any) -> None:
    """np.copyto's signature, summing instead."""
    import numpy as np

    np.add(src, dst, out=dst)


def _on_every_core(pool: Any, op: Callable[[Any, Any], Any], pairs: list[tuple[Any, Any]],
                   reps: int) -> None:
    list(pool.map(partial(_repeat, op, reps=reps), pairs))


def _repeat(op: Callable[[Any, Any], Any], ab: tuple[Any, Any], reps: int) -> None:
    dst, src = ab
    for _ in range(reps):
        op(dst, src)


def repeated(run: Callable[[Job], dict[str, Any] | None], job: Job,
             times: int) -> dict[str, Any] | None:
    """The job `times` times; each figure the median of the runs (a short run on a
    shared machine meets another process now and then)."""
    runs = [d for d in (run(job) for _ in range(job.repeat or times)) if d is not None]
    if not runs:
        return None
    merged: dict[tuple[Any, ...], list[float]] = {}
    for d in runs:
        for r in d["rows"]:
            merged.setdefault((r["kind"], r.get("where"), r["bytes"]), []).append(r["seconds"])
    best: dict[tuple[Any, ...], float] = {}
    for d in runs:
        for r in d["rows"]:
            key = (r["kind"], r.get("where"), r["bytes"])
            best[key] = min(best.get(key, math.inf), r.get("min", r["seconds"]))
    rows = [{"kind": k, "where": w, "bytes": b, "seconds": median(v),
             "best": best[(k, w, b)], "runs": v} for (k, w, b), v in merged.items()]
    idle = [i for d in runs for i in d["meta"]["idle"]]
    return {"meta": {**runs[0]["meta"], "runs": len(runs), "idle": idle}, "rows": rows}


def measure(args: argparse.Namespace) -> None:
    stored = load(args.params)
    jobs = stored.get("jobs", [])
    found: list[dict[str, Any]] = []
    if args.measure in ("local", "machine"):
        stored["machine"] = {"rows": machine_rows(), "host": platform.node(),
                             "cpus": os.cpu_count(), "python": platform.python_version()}
    if args.measure == "local":
        found = [d for d in (repeated(partial(run_local, args=args), j, args.repeat)
                             for j in local_jobs(args)) if d is not None]
    elif args.measure == "netrig":
        found = measure_netrig(args)
    replaced = {job_key(d["meta"]) for d in found}
    jobs = [d for d in jobs if job_key(d["meta"]) not in replaced] + found
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    stored.update(jobs=jobs, measured={**stored.get("measured", {}), args.measure: stamp})
    Path(args.params).write_text(json.dumps(stored, indent=1) + "\n")
    print(f"# wrote {args.params}: {len(found)} jobs ({args.measure}, {stamp})")


def job_key(meta: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a job: a new run of it replaces the stored one."""
    return (meta["where"], meta["kind"], meta["n"], meta["ppn"], meta.get("horovod", False))


def load(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    return json.loads(p.read_text()) if p.exists() else {}
