"""Horovod's synthetic benchmark through the import swap: Horovod vs asynclock, same batch.

Run (the driver; it starts every job itself, one at a time):
    python bench/hvd_synthetic.py [--launchers gloo,mpi] [--models resnet18,mlp,cnn]
                                  [--fp16 both] [--runs 3] [--timeline] [--json PATH]

Each job is `horovodrun -np N [--gloo] python bench/hvd_synthetic.py worker --lib L ...`:
Horovod's `examples/pytorch/pytorch_synthetic_benchmark.py` loop, with `import
horovod.torch as hvd` resolved to Horovod 0.28.1 itself (`--lib horovod`) or to
`asynclock.torch` (`--lib asynclock`): a DistributedOptimizer over named parameters
(`--fp16-allreduce`: Compression.fp16), rank 0's parameters and optimizer state
broadcast, then warm-up batches and timed iterations of batches on synthetic data.
Models: a resnet18 built from torch alone (torchvision's layout, 11.7 M parameters;
the example's default model), and bench/train.py's MLP and CNN at that script's
input sizes. One torch thread per rank unless `--threads`.

For every (launcher, model, compression) the two libraries run `--runs` times each,
alternating which goes first, so a noisy neighbour slows both alike; the table gives
the median of the runs of img/s per rank (the mean over timed iterations, as the
example prints it) and asynclock's median over Horovod's. The JSON also holds rank 0's
CPU milliseconds per timed step by thread name. Each job's whole output is
searched for Horovod's warnings (`W .../horovod/common/...`), counted per job.
`--timeline`: one more short job per library under `--gloo` with HOROVOD_TIMELINE
set; Horovod's coordinator records a negotiation for every tensor, and one with no
rank ticks in it was answered from the response cache, so hits / negotiations of the
kinds Horovod caches (allreduce, allgather, alltoall) is the cache hit rate.

Before each job the driver waits (polling every 30 s) until no other heavy job
(pytest ranks, benches, mpirun, mpiexec, horovodrun) runs on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEAVY = re.compile(r"rank_pytest|bench/|mpirun|mpiexec|horovodrun")
WARNING = re.compile(r": W [^\]]*horovod/common/[\w/]+\.\w+:\d+\]")
CACHED_KINDS = ("NEGOTIATE_ALLREDUCE", "NEGOTIATE_ALLGATHER", "NEGOTIATE_ALLTOALL")


# -- models (torch only: no torchvision here) -----------------------------------------------
def _block(torch: Any, cin: int, cout: int, stride: int) -> Any:
    nn = torch.nn

    class BasicBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x: Any) -> Any:
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(out)) + identity)

    return BasicBlock()


def resnet18(torch: Any) -> Any:
    """torchvision's resnet18: the same layers, parameter names and shapes."""
    nn = torch.nn

    class ResNet18(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            widths = [(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)]
            for i, (cin, cout, stride) in enumerate(widths, 1):
                setattr(self, f"layer{i}", nn.Sequential(_block(torch, cin, cout, stride),
                                                         _block(torch, cout, cout, 1)))
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, 1000)

        def forward(self, x: Any) -> Any:
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return ResNet18()


def mlp(torch: Any) -> Any:
    """bench/train.py's MLP."""
    dims = [1024, 2048, 2048, 2048]
    layers: list[Any] = []
    for a, b in zip(dims, dims[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(2048, 10))


def cnn(torch: Any) -> Any:
    """bench/train.py's CNN."""
    nn, r = torch.nn, torch.nn.ReLU
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), r(), nn.Conv2d(32, 64, 3, padding=1), r(),
        nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), r(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8192, 1024), r(), nn.Linear(1024, 10))


# model -> (builder, input shape, classes, batch size)
MODELS: dict[str, tuple[Any, tuple[int, ...], int, int]] = {
    "resnet18": (resnet18, (3, 224, 224), 1000, 16),
    "mlp": (mlp, (1024,), 10, 32),
    "cnn": (cnn, (3, 32, 32), 10, 32),
}
# model -> warm-up batches, timed iterations, batches per iteration (the example's are
# 10, 10, 10; a resnet18 step takes seconds on one CPU thread, so it runs fewer)
STEPS = {"resnet18": (3, 3, 5), "mlp": (10, 10, 10), "cnn": (10, 10, 10)}


# -- one rank of one job ----------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F  # noqa: N812

    if args.lib == "asynclock":
        import asynclock.torch as hvd
    else:
        import horovod.torch as hvd  # type: ignore[no-redef]

    torch.set_num_threads(args.threads)
    hvd.init()
    build, shape, classes, batch = MODELS[args.model]
    batch = args.batch or batch
    torch.manual_seed(0)
    model = build(torch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    tuning = {"tuning": tuning_of(args.tuning)} if args.tuning else {}
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, **tuning)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data = torch.randn(batch, *shape)
    target = torch.LongTensor(batch).random_() % classes

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    warmup, iters, per_iter = steps(args, args.model)
    timeit.timeit(benchmark_step, number=warmup)
    img_secs = []
    cpu0 = thread_cpu()
    for _ in range(iters):
        seconds = timeit.timeit(benchmark_step, number=per_iter)
        img_secs.append(batch * per_iter / seconds)
    cpu = {name: 1e3 * (t - cpu0.get(name, 0.0)) / (iters * per_iter)
           for name, t in thread_cpu().items()}
    if hvd.rank() == 0:
        busy = {n: round(ms, 1) for n, ms in sorted(cpu.items(), key=lambda kv: -kv[1])
                if ms >= 0.5}
        print("RESULT " + json.dumps({"img_sec": statistics.fmean(img_secs),
                                      "iters": img_secs, "size": hvd.size(),
                                      "cpu_ms_per_step": busy}), flush=True)


def tuning_of(text: str) -> Any:
    """`asynclock.torch.Tuning` from `key=value,...` (asynclock jobs only)."""
    from dataclasses import fields

    import asynclock.torch as al

    kinds = {f.name: f.type for f in fields(al.Tuning)}
    given: dict[str, Any] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        kind = str(kinds[key])
        given[key] = (value.lower() in ("1", "true", "yes") if "bool" in kind
                      else float(value) if "float" in kind else value)
    return al.Tuning(**given)


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each of this process's threads, by thread name (Linux); the
    main thread is `main`, other threads without a name of their own (Horovod's
    background thread among them) `python`."""
    import threading

    main = str(threading.main_thread().native_id)
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            name = "main" if task.name == main else (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        out[name] = out.get(name, 0.0) + ns * 1e-9
    return out


def steps(args: argparse.Namespace, model: str) -> tuple[int, int, int]:
    """Warm-up batches, timed iterations and batches per iteration: given, or the model's."""
    given = (args.warmup, args.iters, args.batches_per_iter)
    return tuple(g if g is not None else d  # type: ignore[return-value]
                 for g, d in zip(given, STEPS[model], strict=True))


# -- the driver ---------------------------------------------------------------------------------
def others_running(mine: set[int]) -> list[str]:
    """Command lines of heavy jobs on this machine that are not this driver's."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if HEAVY.search(cmd):
            found.append(f"{entry.name} {cmd[:120]}")
    return found


def ancestors() -> set[int]:
    """This process and the processes it runs under (their command lines may match)."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids


def wait_quiet(args: argparse.Namespace) -> None:
    if args.no_wait:
        return
    mine = ancestors()
    while True:
        busy = others_running(mine)
        if not busy:
            return
        print(f"# waiting for other jobs: {busy[0]}" + (f" (+{len(busy) - 1})" if busy[1:] else ""),
              file=sys.stderr, flush=True)
        time.sleep(30)


def environ(launcher: str) -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "mpi"))
    import mpi_select

    env = dict(os.environ) if launcher == "gloo" else mpi_select.environ_for("system")
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    env.pop("ASYNCLOCK_BACKEND", None)  # auto: MPI under mpirun, Horovod under --gloo
    return env


def job(args: argparse.Namespace, launcher: str, lib: str, model: str, fp16: bool,
        extra_env: dict[str, str] | None = None, short: bool = False) -> dict[str, Any]:
    """One horovodrun job; its figures, its Horovod warnings and its whole output."""
    wait_quiet(args)
    horovodrun = Path(sys.executable).with_name("horovodrun")
    cmd = [str(horovodrun), "-np", str(args.np), *(["--gloo"] if launcher == "gloo" else []),
           sys.executable, str(Path(__file__).resolve()), "worker", "--lib", lib,
           "--model", model, "--threads", str(args.threads)]
    warmup, iters, per_iter = steps(args, model)
    cmd += ["--warmup", str(min(warmup, 2) if short else warmup),
            "--iters", str(min(iters, 2) if short else iters), "--batches-per-iter", str(per_iter)]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    if fp16:
        cmd.append("--fp16-allreduce")
    if args.tuning and lib == "asynclock":
        cmd += ["--tuning", args.tuning]
    env = {**environ(launcher), **(extra_env or {})}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
        out += f"\n*** TIMEOUT after {args.timeout}s ***"
    found = re.search(r"RESULT (\{.*\})", out)
    result: dict[str, Any] = json.loads(found.group(1)) if found else {}
    result.update(warnings=len(WARNING.findall(out)), returncode=proc.returncode,
                  wall_s=time.perf_counter() - t0)
    if not found or proc.returncode:
        result["output_tail"] = out[-3000:]
    elif result["warnings"]:
        result["warning_lines"] = sorted({m.group(0) for m in WARNING.finditer(out)})
    return result


def timeline_events(path: Path) -> list[dict[str, Any]]:
    """A Horovod timeline's events (the file of a job cut short lacks its closing `]`)."""
    text = path.read_text().rstrip()
    events: list[dict[str, Any]] = json.loads(
        text if text.endswith("]") else text.rstrip(",") + "]")
    return events


def tensor_names(path: Path) -> list[str]:
    """The tensor names in a Horovod timeline (one row of the trace each)."""
    return [e["args"].get("name", "") for e in timeline_events(path)
            if e.get("ph") == "M" and e.get("name") == "process_name"]


def negotiations_by_name(path: Path) -> dict[str, int]:
    """How often Horovod negotiated each tensor name in a timeline."""
    names: dict[int, str] = {}
    counts: dict[str, int] = {}
    for e in timeline_events(path):
        pid = e.get("pid")
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[pid] = e["args"].get("name", "")
        elif e.get("ph") == "B" and str(e.get("name", "")).startswith("NEGOTIATE_"):
            name = names.get(pid, "")
            counts[name] = counts.get(name, 0) + 1
    return counts


def cache_rate(path: Path) -> dict[str, Any]:
    """Negotiations of cached kinds in a Horovod timeline, and how many were cache hits
    (no rank ticks between the negotiation's begin and end)."""
    events = timeline_events(path)
    open_: dict[int, list[Any]] = {}  # pid -> [phase, ticks] of the negotiation in progress
    names: dict[int, str] = {}
    hits = misses = 0
    for e in events:
        pid = e.get("pid")
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[pid] = e["args"].get("name", "")
        elif e.get("ph") == "B" and str(e.get("name", "")).startswith("NEGOTIATE_"):
            open_[pid] = [e["name"], 0]
        elif e.get("ph") == "X" and pid in open_:
            open_[pid][1] += 1
        elif e.get("ph") == "E" and pid in open_:
            kind, ticks = open_.pop(pid)
            if kind in CACHED_KINDS:
                hits += ticks == 0
                misses += ticks > 0
    total = hits + misses
    return {"negotiations": total, "cache_hits": hits,
            "hit_rate": hits / total if total else None, "tensor_names": len(names)}


def timeline_job(args: argparse.Namespace, lib: str, model: str, fp16: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timeline.json"
        result = job(args, "gloo", lib, model, fp16, {"HOROVOD_TIMELINE": str(path)}, short=True)
        if path.exists():
            result.update(cache_rate(path))
            if args.keep_timeline:
                keep = Path(args.keep_timeline)
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, keep / f"{lib}-{model}-{'fp16' if fp16 else 'fp32'}.json")
        return result


def driver(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {"args": vars(args), "rows": []}
    for launcher in args.launchers.split(","):
        for model in args.models.split(","):
            for fp16 in {"both": (False, True), "on": (True,), "off": (False,)}[args.fp16]:
                libs = args.libs.split(",")
                runs: dict[str, list[dict[str, Any]]] = {lib: [] for lib in libs}
                for r in range(args.runs):
                    for lib in libs if r % 2 == 0 else libs[::-1]:
                        runs[lib].append(job(args, launcher, lib, model, fp16))
                        show_run(launcher, model, fp16, lib, runs[lib][-1])
                row = summarize(launcher, model, fp16, runs)
                if args.timeline and launcher == "gloo":
                    row["timeline"] = {lib: timeline_job(args, lib, model, fp16) for lib in libs}
                out["rows"].append(row)
                show_row(row)
    table(out["rows"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


def show_run(launcher: str, model: str, fp16: bool, lib: str, r: dict[str, Any]) -> None:
    img = f"{r['img_sec']:.2f}" if "img_sec" in r else "FAILED"
    print(f"# {launcher} {model} {'fp16' if fp16 else 'fp32'} {lib}: {img} img/s per rank, "
          f"{r['warnings']} Horovod warnings, {r['wall_s']:.0f} s", file=sys.stderr, flush=True)
    if "output_tail" in r:
        print(r["output_tail"], file=sys.stderr, flush=True)


def summarize(launcher: str, model: str, fp16: bool,
              runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    row: dict[str, Any] = {"launcher": launcher, "model": model,
                           "compression": "fp16" if fp16 else "none", "runs": runs}
    for lib in ("horovod", "asynclock"):
        rs = runs.get(lib, [])
        ok = [r["img_sec"] for r in rs if "img_sec" in r]
        row[lib] = statistics.median(ok) if ok and len(ok) == len(rs) else None
        row[f"{lib}_warnings"] = sum(r["warnings"] for r in rs)
    if row["horovod"] and row["asynclock"]:
        row["ratio"] = row["asynclock"] / row["horovod"]
    return row


def show_row(row: dict[str, Any]) -> None:
    print(f"# => {row['launcher']} {row['model']} {row['compression']}: asynclock "
          f"{row['asynclock']} vs horovod {row['horovod']} ({row.get('ratio', 0):.2f}x)",
          file=sys.stderr, flush=True)


def table(rows: list[dict[str, Any]]) -> None:
    print("\n| launcher | model | compression | Horovod img/s | asynclock img/s | ratio | "
          "Horovod warnings (H / a) | cache hits (H / a) |\n|---|---|---|---|---|---|---|---|")

    def fmt(v: Any) -> str:
        return "failed" if v is None else f"{v:.2f}"

    def rate(row: dict[str, Any], lib: str) -> str:
        t = row.get("timeline", {}).get(lib, {})
        return "-" if t.get("hit_rate") is None else f"{t['hit_rate']:.0%} of {t['negotiations']}"

    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else "-"
        print(f"| {row['launcher']} | {row['model']} | {row['compression']} | "
              f"{fmt(row['horovod'])} | {fmt(row['asynclock'])} | {ratio} | "
              f"{row['horovod_warnings']} / {row['asynclock_warnings']} | "
              f"{rate(row, 'horovod')} / {rate(row, 'asynclock')} |")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("worker", help="one rank of one job (horovodrun starts it)")
    w.add_argument("--lib", choices=("horovod", "asynclock"), required=True)
    for q in (p, w):
        q.add_argument("--threads", type=int, default=1, help="torch threads per rank")
        q.add_argument("--batch", type=int, default=0, help="batch size (default: the model's)")
        q.add_argument("--warmup", type=int, help="warm-up batches (default: STEPS)")
        q.add_argument("--iters", type=int, help="timed iterations (default: STEPS)")
        q.add_argument("--batches-per-iter", type=int, help="(default: STEPS)")
        q.add_argument("--tuning", default="", help="asynclock's Tuning, key=value,... "
                       "(asynclock jobs only; e.g. partition=0,bucket_cap_mb=8)")
    w.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    w.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--launchers", default="gloo,mpi", help="gloo: horovodrun --gloo; mpi: Open MPI")
    p.add_argument("--models", default="resnet18,mlp,cnn")
    p.add_argument("--fp16", choices=("both", "on", "off"), default="both")
    p.add_argument("--runs", type=int, default=3, help="jobs per library and row")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--timeline", action="store_true", help="also measure the cache hit rate")
    p.add_argument("--libs", default="horovod,asynclock", help="which libraries to run")
    p.add_argument("--keep-timeline", help="copy each timeline job's trace into this folder")
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    p.add_argument("--json", help="write every run's figures here")
    return p.parse_args()


if __name__ == "__main__":
    ARGS = parse()
    worker(ARGS) if ARGS.command == "worker" else driver(ARGS)
