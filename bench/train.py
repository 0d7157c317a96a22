"""Training throughput per rank: compute only, naive, Horovod, DDP and asynclock, same run.

Run: mpiexec -n 2 python bench/train.py [--json PATH] [--models mlp,cnn]
     (Horovod needs its MPI: eval "$(python3 mpi/mpi_select.py env system)" and
      $(python3 mpi/mpi_select.py launcher system -n 2) python bench/train.py;
      `horovodrun -np 2 python bench/train.py` runs it on that MPI too. Under
      `horovodrun --gloo` there is no MPI world to time over: bench/hvd_synthetic.py
      runs these models through Horovod's own loop there, Horovod vs asynclock)

Every method trains its own copy of the same model (same init, same data,
SGD with momentum, one torch thread per rank) in the same job. Methods take
turns window by window, so a noisy neighbour slows all of them alike; each
figure is the median over windows of samples/s per rank (the slowest rank's
time in each window); the best window and the CPU time per step (every
thread of rank 0's process) are shown too, because on a shared machine they
move less than wall time. Exposed communication = 1 - compute-only step
time / method step time. Methods:

* compute: forward, backward, step; no communication at all;
* naive: backward, then one blocking mpi4py Allreduce of all gradients flattened;
* horovod: horovod.torch.DistributedOptimizer (skipped unless it loads);
* ddp: torch DistributedDataParallel on gloo (env from MPI rank/size);
* asynclock: asynclock.torch.DistributedOptimizer (Horovod API, whole step);
* asynclock-bucket: the same, optimizer applied per bucket as buckets arrive;
* asynclock-gated: the same, next forward gated per layer (agreed priority order);
* asynclock-gated-mpi: gated, buckets as MPI allreduces instead of the shared window;
* asynclock-sharded: `shard_optimizer=True`: parameters and optimizer state once per
  node, each rank updating the chunks it reduces (one node only);
* asynclock-sharded-gated: the same with the next forward gated per layer;
* asynclock-async: the async API (`coord.train_step`, gated) driven from a loop thread;
* asynclock-async-hvd: the same on asynclock's Horovod transport (when Horovod loads);
* asynclock-async-sharded: the async API with `shard_optimizer=True` (one node);
* bound-comm, bound-overlap: not methods but what the machine allows (`bound`):
  the gradient bytes' allreduce alone, and beside backward from its first moment.

Under each table: the best asynclock method over the best peer (naive, Horovod,
DDP) and over compute only, the two ratios the targets are stated in, and a line
"asynclock CPU per step / DDP's": the CPU per step of the best asynclock method, and
of each other one, over DDP's (also `ratios` in the JSON: `best_cpu_vs_ddp`, `cpu_vs_ddp`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__" and os.environ.get("HOROVOD_CONTROLLER") == "gloo":
    # Every method here times and agrees over an MPI world, which `horovodrun --gloo`
    # does not start: each rank would train alone.
    sys.exit("bench/train.py needs an MPI world; under `horovodrun --gloo` run its models "
             "through Horovod's own loop: python bench/hvd_synthetic.py --launchers gloo "
             "--models mlp,cnn")

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from timing import Stopwatch, median  # noqa: E402

WORLD = MPI.COMM_WORLD
Step = Callable[[], None]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here (rank 0)")
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--methods", default="compute,naive,horovod,ddp,asynclock,"
                   "asynclock-bucket,asynclock-gated,asynclock-gated-mpi,asynclock-sharded,"
                   "asynclock-sharded-gated,asynclock-async,asynclock-async-hvd,"
                   "asynclock-async-sharded")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4, help="steps per method before timing")
    p.add_argument("--windows", type=int, default=7)
    p.add_argument("--steps", type=int, default=6, help="steps per timed window")
    p.add_argument("--threads", action="store_true",
                   help="also print rank 0's CPU per step of each thread, by name")
    p.add_argument("--bucket-mb", type=float, default=None, help="asynclock bucket cap")
    p.add_argument("--partition", choices=("auto", "on", "off"), default="auto",
                   help="asynclock: cut tensors at bucket boundaries (Tuning.partition)")
    p.add_argument("--compression", choices=("none", "fp16"), default="none",
                   help="gradient compression for Horovod and asynclock (DDP: none)")
    p.add_argument("--link", default=None,
                   help="label of the network between hosts (e.g. 5gbit); stored in the JSON")
    return p.parse_args()


# -- models -----------------------------------------------------------------------------
def mlp() -> torch.nn.Module:
    dims = [1024, 2048, 2048, 2048]
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims, dims[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(2048, 10))


def cnn() -> torch.nn.Module:
    r = torch.nn.ReLU
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), r(), torch.nn.Conv2d(32, 64, 3, padding=1), r(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(64, 128, 3, padding=1), r(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8192, 1024), r(), torch.nn.Linear(1024, 10))


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]] = {
    "mlp": (mlp, (1024,)), "cnn": (cnn, (3, 32, 32))}


class Trainer:
    """One method's model, optimizer and data; `step()` is one training step."""

    def __init__(self, model_name: str, batch: int) -> None:
        build, shape = MODELS[model_name]
        torch.manual_seed(0)
        self.model = build()
        self.opt: Any = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(1 + WORLD.rank)
        self.x = torch.randn(batch, *shape, generator=g)
        self.y = torch.randint(0, 10, (batch,), generator=g)
        self.forward: Callable[[], torch.Tensor] = lambda: self.model(self.x)

    def loss(self) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.forward(), self.y)

    def plain_step(self) -> None:
        self.opt.zero_grad()
        self.loss().backward()
        self.opt.step()


# -- methods ----------------------------------------------------------------------------
def compute(t: Trainer, args: argparse.Namespace) -> Step:
    return t.plain_step


def naive(t: Trainer, args: argparse.Namespace) -> Step:
    params = list(t.model.parameters())

    def step() -> None:
        t.opt.zero_grad()
        t.loss().backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        WORLD.Allreduce(MPI.IN_PLACE, flat.numpy())
        flat /= WORLD.size
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset: offset + n].view_as(p))
            offset += n
        t.opt.step()

    return step


class HorovodRuntime:
    """Horovod, running only while a method that uses it is warmed up or timed.

    Horovod's background thread negotiates over MPI every cycle (1 ms) with or
    without work, spinning on the cores the other methods train on: with it
    idle in the process, compute-only fell from 888 to 541 samples/s per rank
    (MLP, 2 ranks on 2 cores). So it is shut down between its own windows
    (`hvd.init()` again after `hvd.shutdown()` is supported; the model and
    optimizer carry over)."""

    def __init__(self) -> None:
        self.hvd: Any = None
        self.running = False

    def up(self) -> Any:
        if self.hvd is None:
            self.hvd = _load_horovod()
        elif not self.running:
            self.hvd.init(comm=WORLD)
        self.running = True
        return self.hvd

    def down(self, step: Step | None = None) -> None:
        """Shut Horovod down once `step`'s deferred updates landed (nothing in flight)."""
        if self.running:
            settle(step)
            self.hvd.shutdown()
        self.running = False


def settle(step: Step | None) -> None:
    """Let `step`'s deferred work land (gated updates, an async step's last round)."""
    getattr(step, "settle", lambda: None)()


HOROVOD = HorovodRuntime()
USES_HOROVOD = {"horovod", "asynclock-async-hvd"}


def horovod(t: Trainer, args: argparse.Namespace) -> Step:
    hvd = HOROVOD.up()
    compression = getattr(hvd.Compression, args.compression)
    t.opt = hvd.DistributedOptimizer(t.opt, named_parameters=t.model.named_parameters(),
                                      compression=compression)
    return t.plain_step


def _load_horovod() -> Any:
    """Horovod shares our MPI world only if it was built for this MPI (Open MPI here)."""
    if "Open MPI" not in MPI.Get_library_version():
        raise RuntimeError("Horovod is built against the system Open MPI, and this job runs "
                           "on another MPI; launch with mpi/mpi_select.py's system launcher")
    import horovod.torch as hvd

    hvd.init(comm=WORLD)
    return hvd


def gloo_world() -> None:
    """torch.distributed's default group on gloo, its rendezvous found through MPI."""
    import torch.distributed as dist

    if not dist.is_initialized():
        hosts = WORLD.allgather(platform.node())
        port, addr = 0, "127.0.0.1"
        if WORLD.rank == 0:
            if len(set(hosts)) > 1:  # ranks on other hosts: rank 0's own address
                addr = socket.gethostbyname(socket.gethostname())
            with socket.socket() as s:
                s.bind((addr, 0))
                port = s.getsockname()[1]
        addr, port = WORLD.bcast((addr, port), root=0)
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port),
                          RANK=str(WORLD.rank), WORLD_SIZE=str(WORLD.size))
        dist.init_process_group("gloo", rank=WORLD.rank, world_size=WORLD.size)


def ddp(t: Trainer, args: argparse.Namespace) -> Step:
    gloo_world()
    wrapped = torch.nn.parallel.DistributedDataParallel(t.model)
    t.forward = lambda: wrapped(t.x)
    return t.plain_step


def bound(t: Trainer, args: argparse.Namespace, overlap: bool) -> Step:
    """Not a method: what the machine allows any method. A buffer of the model's
    gradient bytes is allreduced over gloo (DDP's transport) in one call.

    * bound-comm: that allreduce alone each step, no compute;
    * bound-overlap: launched as backward starts, beside backward and the
      optimizer step, and waited for at the end: every gradient byte on the
      wire from the first moment of backward. No method can do that, since
      backward produces gradients one layer at a time, so this is an upper
      bound on what overlapping communication with backward can give. The
      data is not the gradients: only the time counts.
    """
    import torch.distributed as dist

    gloo_world()
    flat = torch.zeros(sum(p.numel() for p in t.model.parameters()))

    def step() -> None:
        if not overlap:
            dist.all_reduce(flat)
            return
        t.opt.zero_grad()
        loss = t.loss()
        work = dist.all_reduce(flat, async_op=True)
        loss.backward()
        t.opt.step()
        work.wait()

    return step


def tuning(args: argparse.Namespace, shm: bool = True) -> Any:
    from asynclock.torch import Tuning

    partition = {"auto": None, "on": True, "off": False}[args.partition]
    if args.bucket_mb is None:
        return Tuning(shm=shm, partition=partition)
    return Tuning(bucket_cap_mb=args.bucket_mb, first_bucket_mb=min(1.0, args.bucket_mb), shm=shm,
                  partition=partition)


def asynclock_opt(t: Trainer, args: argparse.Namespace, shm: bool = True, **kw: Any) -> Step:
    import asynclock.torch as alk

    alk.init()
    if args.compression != "none":
        kw["compression"] = getattr(alk.Compression, args.compression)
    t.opt = alk.DistributedOptimizer(t.opt, named_parameters=t.model.named_parameters(),
                                     tuning=tuning(args, shm), **kw)

    def step() -> None:
        t.plain_step()

    step.settle = t.opt.apply_pending  # type: ignore[attr-defined]
    return step


_ASYNC: dict[str, Any] = {}


def asynclock_async(t: Trainer, args: argparse.Namespace, backend: str = "mpi",
                    **kw: Any) -> Step:
    """The async API (`coord.train_step`, gated forward) on its own coordinator and
    loop thread; each step is one `async with step:` block driven through a portal."""
    from anyio.from_thread import start_blocking_portal

    import asynclock
    from asynclock._core.runtime.coordinator import make_backend
    from asynclock.torch import training_policy

    if backend == "horovod":
        HOROVOD.up()  # or say why it cannot load
    if backend not in _ASYNC:  # Coordinator(): a collective, every rank at the same point
        coord = asynclock.Coordinator(make_backend(backend, WORLD), training_policy())
        portal_cm = start_blocking_portal()
        portal = portal_cm.__enter__()
        running = portal.wrap_async_context_manager(coord.running())
        running.__enter__()
        _ASYNC[backend] = (coord, portal, portal_cm, running)
    coord, portal = _ASYNC[backend][0], _ASYNC[backend][1]

    async def make() -> Any:
        return coord.train_step(t.opt, model=t.model, gate_forward=True, tuning=tuning(args),
                                **kw)

    train_step = portal.call(make)

    async def one() -> None:
        async with train_step:
            loss = await train_step.forward(t.loss)
            await train_step.backward(loss)

    def run() -> None:
        portal.call(one)

    async def settle() -> None:
        await train_step.flush()

    run.settle = lambda: portal.call(settle)  # type: ignore[attr-defined]
    return run


METHODS: dict[str, Callable[[Trainer, argparse.Namespace], Step]] = {
    "compute": compute, "naive": naive, "horovod": horovod, "ddp": ddp,
    "asynclock": asynclock_opt,
    "asynclock-bucket": lambda t, a: asynclock_opt(t, a, per_bucket_step=True),
    "asynclock-gated": lambda t, a: asynclock_opt(t, a, gate_forward=t.model),
    "asynclock-gated-mpi": lambda t, a: asynclock_opt(t, a, False, gate_forward=t.model),
    "asynclock-sharded": lambda t, a: asynclock_opt(t, a, shard_optimizer=True),
    "asynclock-sharded-gated": lambda t, a: asynclock_opt(t, a, shard_optimizer=True,
                                                          gate_forward=t.model),
    "asynclock-async": asynclock_async,
    "asynclock-async-hvd": lambda t, a: asynclock_async(t, a, "horovod"),
    "asynclock-async-sharded": lambda t, a: asynclock_async(t, a, shard_optimizer=True),
    "bound-comm": lambda t, a: bound(t, a, overlap=False),
    "bound-overlap": lambda t, a: bound(t, a, overlap=True),
}


# -- timing -----------------------------------------------------------------------------
def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each of this process's threads, by thread name
    (schedstat: nanoseconds on a CPU; Linux only, else empty)."""
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").glob("*") if sys.platform == "linux" else ():
        try:
            name = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        out[name] = out.get(name, 0.0) + ns * 1e-9
    return out


def window(step: Step, n: int, threads: dict[str, float] | None = None
           ) -> tuple[float, float]:
    """Seconds for n steps on the slowest rank (all ranks start together), and the
    CPU seconds this rank's process used meanwhile (every thread counts); adds
    each thread's CPU seconds into `threads` when given (`--threads`)."""
    WORLD.Barrier()
    before = thread_cpu() if threads is not None else {}
    with Stopwatch() as sw:
        for _ in range(n):
            step()
        settle(step)  # a gated method's deferred round is its work too
    wall, cpu = sw.wall, sw.cpu
    if threads is not None:
        for name, sec in thread_cpu().items():
            threads[name] = threads.get(name, 0.0) + sec - before.get(name, 0.0)
    return float(WORLD.allreduce(wall, op=MPI.MAX)), cpu


def prepare(model: str, names: list[str], args: argparse.Namespace) -> dict[str, Step]:
    steps: dict[str, Step] = {}
    for name in names:
        trainer = Trainer(model, args.batch)
        try:
            steps[name] = METHODS[name](trainer, args)
        except Exception as exc:  # e.g. Horovod built for another MPI: note and go on
            note(f"{model}/{name} skipped: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        for _ in range(args.warmup):
            steps[name]()
        HOROVOD.down(steps[name])
    return steps


def measure(model: str, names: list[str], args: argparse.Namespace
            ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Median seconds per step of each method (windows interleaved across
    methods), median CPU seconds per step of rank 0's process, and the best
    window's seconds per step (what a quiet machine gives)."""
    steps = prepare(model, names, args)
    times: dict[str, list[float]] = {n: [] for n in steps}
    cpus: dict[str, list[float]] = {n: [] for n in steps}
    order = list(steps)
    for w in range(args.windows):
        for name in order[w % len(order):] + order[: w % len(order)]:
            per_thread = THREADS.setdefault(model, {}).setdefault(name, {})
            if name in USES_HOROVOD:
                HOROVOD.up()
            wall, cpu = window(steps[name], args.steps, per_thread if args.threads else None)
            HOROVOD.down(steps[name])
            times[name].append(wall / args.steps)
            cpus[name].append(cpu / args.steps)
    return ({n: median(ts) for n, ts in times.items()},
            {n: median(cs) for n, cs in cpus.items()},
            {n: min(ts) for n, ts in times.items()})


THREADS: dict[str, dict[str, dict[str, float]]] = {}  # model -> method -> thread -> s


def thread_table(model: str, args: argparse.Namespace) -> None:
    """`--threads`: rank 0's CPU ms per step of each thread, by thread name."""
    steps = args.windows * args.steps
    for method, threads in THREADS.get(model, {}).items():
        busy = sorted(threads.items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{n} {1e3 * s / steps:.1f}" for n, s in busy if s * 1e3 / steps >= 0.5)
        print(f"  {method:20s} cpu ms/step by thread: {shown}")


def note_bulk_choice() -> None:
    """Across hosts asynclock may send large allreduces over gloo: say what it chose."""
    if "asynclock.torch" not in sys.modules:
        return
    from asynclock._core.runtime import coordinator as runtime

    coord = runtime.coordinator() if runtime.is_initialized() else None
    choice = getattr(getattr(coord, "backend", None), "bulk_choice", "")
    if choice:
        note(f"asynclock bulk allreduces: {choice}")


def note(text: str) -> None:
    if WORLD.rank == 0:
        print(f"# {text}", file=sys.stderr, flush=True)


def system_info() -> dict[str, Any]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "ranks": WORLD.size,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "python": platform.python_version(),
            "asynclock_backend": os.environ.get("ASYNCLOCK_BACKEND", "auto")}


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    names = args.methods.split(",")
    out: dict[str, Any] = {"system": system_info(), "link": args.link, "model": {},
                           "samples_per_s": {},
                           "exposed_comm": {}, "step_ms": {}, "cpu_ms_per_step": {},
                           "samples_per_s_best_window": {}, "ratios": {}}
    for model in args.models.split(","):
        per_step, cpu, best = measure(model, names, args)
        out["cpu_ms_per_step"][model] = {n: 1e3 * c for n, c in cpu.items()}
        out["samples_per_s_best_window"][model] = {n: args.batch / s for n, s in best.items()}
        params = sum(p.numel() for p in MODELS[model][0]().parameters())
        out["model"][model] = {"params": params, "batch": args.batch}
        out["samples_per_s"][model] = {n: args.batch / s for n, s in per_step.items()}
        out["step_ms"][model] = {n: 1e3 * s for n, s in per_step.items()}
        if "compute" in per_step:
            out["exposed_comm"][model] = {n: max(0.0, 1 - per_step["compute"] / s)
                                          for n, s in per_step.items() if n != "compute"}
        out["ratios"][model] = ratios(out["samples_per_s"][model])
        out["ratios"][model].update(cpu_ratios(out["cpu_ms_per_step"][model],
                                               out["ratios"][model].get("best_asynclock")))
        table(model, out)
        if args.threads and WORLD.rank == 0:
            thread_table(model, args)
    note_bulk_choice()
    if args.json and WORLD.rank == 0:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    finish()


PEERS = ("naive", "horovod", "ddp")


def ratios(sps: dict[str, float]) -> dict[str, Any]:
    """The issue's two ratios: the best asynclock method over the best peer and
    over compute only (each None where that row was not run)."""
    mine = {n: v for n, v in sps.items() if n.startswith("asynclock")}
    peers = {n: v for n, v in sps.items() if n in PEERS}
    if not mine:
        return {}
    best = max(mine, key=mine.__getitem__)
    peer = max(peers, key=peers.__getitem__) if peers else None
    return {"best_asynclock": best, "best_peer": peer,
            "vs_best_peer": sps[best] / sps[peer] if peer else None,
            "vs_compute": sps[best] / sps["compute"] if "compute" in sps else None,
            "overlap_bound_vs_best_peer": (sps["bound-overlap"] / sps[peer]
                                           if peer and "bound-overlap" in sps else None)}


def cpu_ratios(cpu_ms: dict[str, float], best: str | None) -> dict[str, Any]:
    """CPU per step of every asynclock method over DDP's (rank 0's process, every
    thread), and of the best asynclock method by samples/s; empty without DDP."""
    ddp = cpu_ms.get("ddp")
    if not ddp:
        return {}
    each = {n: c / ddp for n, c in cpu_ms.items() if n.startswith("asynclock")}
    return {"cpu_vs_ddp": each, "best_cpu_vs_ddp": each.get(best) if best else None}


def cpu_line(cpu_ms: dict[str, float], r: dict[str, Any]) -> str:
    """The line the CPU target is read from: asynclock's CPU per step over DDP's."""
    each = r.get("cpu_vs_ddp") or {}
    if not each:
        return ""
    best = r.get("best_asynclock")
    head = (f"asynclock CPU per step / DDP's: {r['best_cpu_vs_ddp']:.2f}x ({best} "
            f"{cpu_ms[best]:.1f} ms, ddp {cpu_ms['ddp']:.1f} ms)" if best in each
            else "asynclock CPU per step / DDP's:")
    rest = ", ".join(f"{n} {v:.2f}x" for n, v in each.items() if n != best)
    return f"{head}; {rest}" if rest else head


def verdict(r: dict[str, Any]) -> str:
    """One line for the table: the ratios against issue 4's targets (1.2x, 0.8x)."""
    parts = [f"best asynclock: {r['best_asynclock']}"]
    if r["vs_best_peer"] is not None:
        parts.append(f"{r['vs_best_peer']:.2f}x the best peer ({r['best_peer']}; target 1.2x)")
    if r["vs_compute"] is not None:
        parts.append(f"{r['vs_compute']:.2f}x compute only (target 0.8x)")
    if r.get("overlap_bound_vs_best_peer") is not None:
        parts.append(f"overlap bound {r['overlap_bound_vs_best_peer']:.2f}x the best peer")
    return ", ".join(parts)


def table(model: str, out: dict[str, Any]) -> None:
    if WORLD.rank:
        return
    sps, exp = out["samples_per_s"][model], out["exposed_comm"].get(model, {})
    ms, cpu = out["step_ms"][model], out["cpu_ms_per_step"][model]
    best = out["samples_per_s_best_window"][model]
    print(f"\n{model} ({out['model'][model]['params'] / 1e6:.1f} M params, batch "
          f"{out['model'][model]['batch']}, {WORLD.size} ranks; samples/s per rank: median "
          f"and best window)\n  {'method':23s} {'median':>8s} {'best':>7s} {'step ms':>8s} "
          f"{'cpu ms':>7s}  exposed comm")
    for name, v in sps.items():
        extra = f"{exp[name]:.0%}" if name in exp else "-"
        print(f"  {name:23s} {v:8.1f} {best[name]:7.1f} {ms[name]:8.1f} {cpu[name]:7.1f}  "
              f"{extra}")
    if out["ratios"][model].get("best_asynclock"):
        print(f"  {verdict(out['ratios'][model])}")
    line = cpu_line(cpu, out["ratios"][model])
    if line:
        print(f"  {line}")
    sys.stdout.flush()


def finish() -> None:
    if _ASYNC:
        from asynclock.torch import quiesce_all

        quiesce_all()
    for coord, _portal, portal_cm, running in _ASYNC.values():
        running.__exit__(None, None, None)
        portal_cm.__exit__(None, None, None)
        coord.shutdown()
    if "asynclock.torch" in sys.modules:
        import asynclock.torch

        asynclock.torch.shutdown()  # lets deferred rounds finish on every rank first
    HOROVOD.down()


if __name__ == "__main__":
    main()
