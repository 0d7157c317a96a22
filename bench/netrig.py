"""Across hosts: bench/train.py and bench/collectives.py on a netrig cluster
(../shared/netrig), 2 hosts x 1 rank, every byte between ranks over TCP,
at unlimited and 5 Gbit/s links; and how a cut link ends a job.

Run as root (netrig makes network namespaces):

    python bench/netrig.py                      # train + collectives, both links, both MPIs
    python bench/netrig.py --links 5gbit --mpis openmpi --what train --windows 5
    python bench/netrig.py faults --repeats 3   # cut a link: detection and exit times
    python bench/netrig.py --json runs/netrig.json

Systems side by side, as bench/train.py provides them: compute only, naive
(backward then one blocking Allreduce), Horovod DistributedOptimizer and
asynclock on Horovod (Open MPI only: Horovod is built against it), DDP on
gloo, asynclock on MPI (whole step, per bucket, gated forward), and two
bounds (`bound-comm`: the gradient bytes' allreduce alone; `bound-overlap`:
that allreduce beside backward from its first moment, more than any method
can overlap). Open MPI jobs go through `netrig mpirun`, MPICH jobs through
`netrig mpiexec`. Every JSON row carries a `link` key. The table adds the
wire bound (gradient bytes each rank sends per step at the link rate), the
target asynclock should reach (0.8 x min(compute only, wire bound)), and the
best asynclock method and the overlap bound over the best peer.

Each job is bounded (--job-timeout); the rig is always taken down.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "programs"))
import netrig_rig  # noqa: E402
from netrig_live import LiveJob, rank_pids, wait_gone  # noqa: E402
from timing import median  # noqa: E402

LINKS = {"unlimited": None, "5gbit": "5gbit"}
MPIS = {"openmpi": "system", "mpich": "embedded"}
TARGET = 0.8
# How long a launcher may take after the last rank exited: mpirun waits until TCP gives
# up on the cut host's orted (~15 s with the rig's tcp_retries2=5); mpiexec never returns.
LAUNCHER_GRACE_S = {"openmpi": 30.0, "mpich": 10.0}
Row = dict[str, Any]


@dataclass(frozen=True)
class Spec:
    """One launcher run: a bench script on one MPI, with extra env and renames."""

    label: str
    mpi: str
    script: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    rename: dict[str, str] = field(default_factory=dict)
    drop: tuple[str, ...] = ()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("mode", nargs="?", choices=("bench", "faults"), default="bench")
    add("--links", default="unlimited,5gbit", help=f"from {list(LINKS)} or any tc rate")
    add("--mpis", default="openmpi,mpich", help="openmpi (netrig mpirun), mpich (mpiexec)")
    add("--what", default="train,collectives")
    add("--models", default="mlp,cnn")
    add("--windows", type=int, default=7, help="bench/train.py --windows")
    add("--steps", type=int, default=6, help="bench/train.py --steps")
    add("--threads", action="store_true", help="bench/train.py --threads (CPU per thread)")
    add("--bucket-mb", type=float, default=None, help="bench/train.py --bucket-mb")
    add("--partition", choices=("auto", "on", "off"), default="auto",
        help="bench/train.py --partition")
    add("--env", action="append", default=[], metavar="KEY=VALUE",
        help="extra environment for the ranks of --methods runs (repeatable)")
    add("--methods", default=None, help="bench/train.py --methods (default: every system)")
    add("--compression", choices=("none", "fp16"), default="none",
        help="train: gradient compression for Horovod and asynclock")
    add("--sizes", default=None, help="bench/collectives.py --sizes")
    add("--job-timeout", type=float, default=900.0, help="seconds per launcher run")
    add("--repeats", type=int, default=3, help="faults: runs per case")
    add("--dead-after", type=float, default=10.0, help="faults: ASYNCLOCK_DEAD_AFTER_S")
    add("--json", help="write every row here")
    return p.parse_args()


# -- which runs ------------------------------------------------------------------------------
def specs(args: argparse.Namespace) -> list[Spec]:
    out: list[Spec] = []
    train = ("--models", args.models, "--windows", str(args.windows), "--steps", str(args.steps),
             "--compression", args.compression, *(["--threads"] if args.threads else []),
             *(["--bucket-mb", str(args.bucket_mb)] if args.bucket_mb else []),
             "--partition", args.partition)
    for mpi in args.mpis.split(","):
        if "train" in args.what and args.methods:
            env = dict(kv.split("=", 1) for kv in args.env)
            out.append(Spec(f"{mpi} train", mpi, "train.py", (*train, "--methods", args.methods),
                            env))
        elif "train" in args.what:
            out += train_specs(mpi, train)
        if "collectives" in args.what:
            extra = ("--sizes", args.sizes) if args.sizes else ()
            # Horovod here links Open MPI's libmpi: loaded into an MPICH rank it aborts
            env = {} if mpi == "openmpi" else {"ASYNCLOCK_BENCH_HOROVOD": "0"}
            out.append(Spec(f"{mpi} collectives", mpi, "collectives.py", extra, env))
    return out


def train_specs(mpi: str, train: tuple[str, ...]) -> list[Spec]:
    """Horovod (and asynclock on Horovod) only where Horovod's MPI runs: Open MPI."""
    common = ("compute,naive,ddp,asynclock,asynclock-bucket,asynclock-gated,"
              "bound-comm,bound-overlap")
    if mpi != "openmpi":
        return [Spec(f"{mpi} train", mpi, "train.py", (*train, "--methods", common))]
    return [Spec(f"{mpi} train", mpi, "train.py", (*train, "--methods", "horovod," + common)),
            Spec(f"{mpi} train asynclock-on-horovod", mpi, "train.py",
                 (*train, "--methods", "compute,asynclock"), {"ASYNCLOCK_BACKEND": "horovod"},
                 rename={"asynclock": "asynclock-hvd"}, drop=("compute",))]


# -- running them ----------------------------------------------------------------------------
def run_spec(rig: netrig_rig.Rig, spec: Spec, link: str, timeout: float) -> Any | None:
    """One launcher run; its JSON (rank 0 wrote it), or None when it failed."""
    with tempfile.TemporaryDirectory(prefix="netrig-bench-") as tmp:
        out = Path(tmp) / "out.json"
        argv = [sys.executable, str(ROOT / "bench" / spec.script), *spec.args,
                "--json", str(out), "--link", link]
        t0 = time.monotonic()
        job = rig.start(MPIS[spec.mpi], 2, argv, spec.env)
        code = job.finish(timeout)
        took = time.monotonic() - t0
        print(f"# [{link}] {spec.label}: exit {code} in {took:.0f} s", flush=True)
        notes = [line for line in job.lines
                 if line.startswith("#") or "rror" in line or "by thread" in line]
        for line in notes[-24:]:
            print(f"#   {line[:200]}", flush=True)
        if code != 0:
            print(job.output[-4000:], file=sys.stderr)
        if not out.exists():
            return None
        data = json.loads(out.read_text())  # written before a crash at exit: still figures
        data["exit"] = code
        return data


def train_rows(data: Any, spec: Spec, link: str) -> list[Row]:
    rows = []
    for model, per_method in data.get("samples_per_s", {}).items():
        meta = data.get("model", {}).get(model, {})
        for method, sps in per_method.items():
            if method in spec.drop:
                continue
            rows.append({"link": link, "mpi": spec.mpi, "model": model, "exit": data.get("exit"),
                         "method": spec.rename.get(method, method), "samples_per_s": sps,
                         "step_ms": data.get("step_ms", {}).get(model, {}).get(method),
                         "exposed_comm": data.get("exposed_comm", {}).get(model, {}).get(method),
                         "cpu_ms_per_step": data.get("cpu_ms_per_step", {}).get(model, {})
                         .get(method), "params": meta.get("params"), "batch": meta.get("batch")})
    return rows


def collective_rows(data: Any, spec: Spec, link: str) -> list[Row]:
    rows = [{"link": link, "mpi": spec.mpi, "exit": data.get("exit"), **r}
            for r in data.get("rows", [])]
    for system, frac in (data.get("idle_cpu_fraction") or {}).items():
        rows.append({"link": link, "mpi": spec.mpi, "system": system, "bytes": 0,
                     "idle_cpu_fraction": frac})
    return rows


def bench(args: argparse.Namespace) -> int:
    train: list[Row] = []
    colls: list[Row] = []
    with rig_of(2) as rig:
        for link in args.links.split(","):
            rig.rate(LINKS.get(link, link))
            for spec in specs(args):
                data = run_spec(rig, spec, link, args.job_timeout)
                if data is None:
                    continue
                if spec.script == "train.py":
                    train += train_rows(data, spec, link)
                else:
                    colls += collective_rows(data, spec, link)
    print(render_train(train))
    print(render_collectives(colls))
    write_json(args.json, {"train": train, "collectives": colls})
    return 0 if train or colls else 1


@contextmanager
def rig_of(n: int, tcp_retries2: int | None = None) -> Iterator[netrig_rig.Rig]:
    reason = netrig_rig.unavailable()
    if reason is not None:
        raise SystemExit(f"netrig: {reason}")
    with netrig_rig.Rig() as rig:
        rig.up(n, tcp_retries2=tcp_retries2)
        yield rig


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1))
        print(f"# wrote {path}")


# -- tables ------------------------------------------------------------------------------------
def rate_bps(link: str) -> float | None:
    """'5gbit' -> 5e9; None for an unlimited link."""
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", link.lower())
    if not m:
        return None
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def wire_bound(params: int, batch: int, link: str, ranks: int = 2) -> float | None:
    """Samples/s per rank if the link did nothing but carry the gradients (ring
    allreduce: each rank sends 2(n-1)/n of the float32 gradient bytes per step)."""
    bps = rate_bps(link)
    if bps is None or not params:
        return None
    return batch / (2 * (ranks - 1) / ranks * 4 * params * 8 / bps)


def render_train(rows: list[Row]) -> str:
    cols = sorted({(r["link"], r["mpi"]) for r in rows}, key=_col_order)
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        cell = {(r["link"], r["mpi"], r["method"]): r["samples_per_s"] for r in mine}
        lines += [f"\n{model}: samples/s per rank (median of windows), 2 hosts x 1 rank",
                  f"  {'method':18s}" + "".join(f"{f'{lk}/{m}':>18s}" for lk, m in cols)]
        methods = sorted(dict.fromkeys(r["method"] for r in mine), key=_method_order)
        for method in methods:
            lines.append(f"  {method:18s}" + "".join(
                f"{_num(cell.get((lk, m, method))):>18s}" for lk, m in cols))
        lines += _bounds(mine, cols)
    return "\n".join(lines)


def _bounds(rows: list[Row], cols: list[tuple[str, str]]) -> list[str]:
    """Wire bound and the asynclock target per column."""
    wire, target = [], []
    for link, mpi in cols:
        col = {r["method"]: r for r in rows if (r["link"], r["mpi"]) == (link, mpi)}
        any_row = next(iter(col.values()))
        bound = wire_bound(any_row["params"] or 0, any_row["batch"] or 0, link)
        compute = col.get("compute", {}).get("samples_per_s")
        limits = [v for v in (bound, compute) if v]
        wire.append(_num(bound))
        target.append(_num(TARGET * min(limits)) if limits else "-")
    best = [_num(max((r["samples_per_s"] for r in rows if (r["link"], r["mpi"]) == col
                      and r["method"].startswith("asynclock")), default=None)) for col in cols]
    return [f"  {'wire bound':18s}" + "".join(f"{w:>18s}" for w in wire),
            f"  {'target (asynclock)':18s}" + "".join(f"{t:>18s}" for t in target),
            f"  {'best asynclock':18s}" + "".join(f"{b:>18s}" for b in best),
            f"  {'vs best peer':18s}" + "".join(f"{_peer_ratio(rows, c, 'asynclock'):>18s}"
                                                 for c in cols),
            f"  {'bound vs peer':18s}" + "".join(f"{_peer_ratio(rows, c, 'bound-overlap'):>18s}"
                                                  for c in cols),
            f"  {'cpu/step vs ddp':18s}" + "".join(f"{_cpu_ratio(rows, c):>18s}" for c in cols)]


def _cpu_ratio(rows: list[Row], col: tuple[str, str]) -> str:
    """The best asynclock method's CPU per step (rank 0's process, every thread) over
    DDP's, in one column: bench/train.py's "asynclock CPU per step / DDP's" line."""
    here = {r["method"]: r for r in rows if (r["link"], r["mpi"]) == col}
    mine = [r for m, r in here.items() if m.startswith("asynclock")]
    ddp = here.get("ddp", {}).get("cpu_ms_per_step")
    if not mine or not ddp:
        return "-"
    best = max(mine, key=lambda r: r["samples_per_s"] or 0.0)
    cpu = best.get("cpu_ms_per_step")
    return "-" if not cpu else f"{cpu / ddp:.2f}x"


# bench/train.py's PEERS, not imported: importing train.py starts MPI in this driver.
PEERS = ("naive", "horovod", "ddp")


def _peer_ratio(rows: list[Row], col: tuple[str, str], prefix: str) -> str:
    """The best row whose method starts with `prefix` over the best peer, in one column:
    for `bound-overlap`, the most any method could reach against that peer there."""
    here = {r["method"]: r["samples_per_s"] for r in rows if (r["link"], r["mpi"]) == col}
    mine = max((v for m, v in here.items() if m.startswith(prefix)), default=None)
    peer = max((v for m, v in here.items() if m in PEERS), default=None)
    return "-" if mine is None or not peer else f"{mine / peer:.2f}x"


METHOD_ORDER = ("compute", "naive", "horovod", "ddp", "asynclock", "bound")


def _method_order(method: str) -> tuple[int, str]:
    """Baselines first, then the asynclock variants."""
    first = next((i for i, m in enumerate(METHOD_ORDER) if method.startswith(m)),
                 len(METHOD_ORDER))
    return (first, method)


def render_collectives(rows: list[Row]) -> str:
    timed = [r for r in rows if r.get("seconds_median") is not None]
    cols = sorted({(r["link"], r["mpi"]) for r in timed}, key=_col_order)
    cell = {(r["link"], r["mpi"], r["bytes"], r["system"]): r["seconds_median"] for r in timed}
    keys = list(dict.fromkeys((r["bytes"], r["system"]) for r in timed))
    lines = ["\nallreduce (in place, sum), median time per call, 2 hosts x 1 rank",
             f"  {'bytes':>10s} {'system':12s}" + "".join(f"{f'{lk}/{m}':>18s}"
                                                         for lk, m in cols)]
    for nbytes, system in keys:
        lines.append(f"  {nbytes:>10d} {system:12s}" + "".join(
            f"{_secs(cell.get((lk, m, nbytes, system))):>18s}" for lk, m in cols))
    return "\n".join(lines)


def _col_order(col: tuple[str, str]) -> tuple[int, str]:
    link, mpi = col
    return (list(LINKS).index(link) if link in LINKS else len(LINKS), mpi)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e6:.0f} us" if v < 1e-3 else f"{v * 1e3:.2f} ms"


# -- faults ------------------------------------------------------------------------------------
def faults(args: argparse.Namespace) -> int:
    """Cut the last host's link mid-run; time the report, the ranks' exit, the launcher."""
    rows: list[Row] = []
    env = {"ASYNCLOCK_DEAD_AFTER_S": str(args.dead_after)}
    for n in (2, 3):
        for mpi in args.mpis.split(","):
            # as tests/test_netrig.py: Open MPI's orted on a cut host needs TCP to give up
            with rig_of(n, tcp_retries2=5 if mpi == "openmpi" else None) as rig:
                for i in range(args.repeats):
                    rows.append(cut_once(rig, mpi, n, env, i))
                    rig.reap()
    print(render_faults(rows, args.dead_after))
    write_json(args.json, {"faults": rows})
    return 0


def cut_once(rig: netrig_rig.Rig, mpi: str, n: int, env: dict[str, str], i: int) -> Row:
    with tempfile.TemporaryDirectory(prefix="netrig-cut-") as tmp:
        prog = ROOT / "tests" / "programs" / "netrig_job.py"
        job = rig.start(MPIS[mpi], n, [sys.executable, str(prog), tmp, "--skip-train", "--cut"],
                        env)
        if not job.wait_for("armed", range(n), 120):
            job.finish(0)
            return {"mpi": mpi, "hosts": n, "run": i, "error": job.output[-2000:]}
        pids = rank_pids(job)
        rig.cut(f"nr{n}")
        t_cut = time.monotonic()
        try:
            alive = wait_gone(pids.values(), 60)
            t_ranks = time.monotonic()
            job.finish(LAUNCHER_GRACE_S[mpi])  # still running then: stuck on the cut host
        finally:
            rig.heal(f"nr{n}")
        row = fault_row(job, mpi, n, i, t_cut, rig.leftovers())
        return {**row, "ranks_gone_s": None if alive else t_ranks - t_cut}


def fault_row(job: LiveJob, mpi: str, n: int, i: int, t_cut: float,
              left: list[str]) -> Row:
    hit = job.first(rf"asynclock\[rank \d+\]: .*rank {n - 1} is unreachable")
    return {"mpi": mpi, "hosts": n, "run": i,
            "report_s": None if hit is None else hit[0] - t_cut,
            "report": None if hit is None else hit[1],
            "launcher_returned": job.returned_by_itself, "launcher_exit": job.returncode,
            "launcher_s": (job.ended_at or t_cut) - t_cut, "left_in_hosts": left}


def render_faults(rows: list[Row], dead_after: float) -> str:
    lines = [f"\ncut link, ASYNCLOCK_DEAD_AFTER_S={dead_after:g}: seconds after the cut "
             "(median over runs)",
             f"  {'mpi':8s} {'hosts':>5s} {'runs':>4s} {'report':>8s} {'ranks gone':>10s} "
             f"{'launcher':>9s} {'returned':>9s} {'exits':>8s}  left in hosts"]
    for key in dict.fromkeys((r["mpi"], r["hosts"]) for r in rows):
        mine = [r for r in rows if (r["mpi"], r["hosts"]) == key and "error" not in r]
        if not mine:
            lines.append(f"  {key[0]:8s} {key[1]:>5d}  (no run reached the cut)")
            continue
        rep = [r["report_s"] for r in mine if r["report_s"] is not None]
        gone = [r["ranks_gone_s"] for r in mine if r["ranks_gone_s"] is not None]
        returned = [r for r in mine if r["launcher_returned"]]
        lines.append(
            f"  {key[0]:8s} {key[1]:>5d} {len(mine):>4d} {_med(rep):>8s} {_med(gone):>10s} "
            f"{_med([r['launcher_s'] for r in returned]):>9s} "
            f"{len(returned):>5d}/{len(mine):<3d} "
            f"{','.join(sorted({str(r['launcher_exit']) for r in mine})):>8s}  "
            f"{max(len(r['left_in_hosts']) for r in mine)}")
    return "\n".join(lines)


def _med(values: list[float]) -> str:
    return f"{median(values):.1f}" if values else "-"


def main() -> int:
    args = parse()
    return faults(args) if args.mode == "faults" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
