"""The tables bench/cost_model.py prints: the fitted parameters, the model against
every measurement (validation), and predictions at scale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

from cost_fit import Points, fit
from cost_formulas import (
    HVD_REQUEST_BYTES,
    SIZES,
    Cost,
    Curve,
    Layout,
    Link,
    Params,
    Rate,
    asynclock_allreduce,
    asynclock_allreduce_hier,
    check_after,
    check_before,
    check_rows,
    compact_wire,
    hvd_allreduce_sync,
    hvd_negotiation,
    hvd_negotiation_miss,
    mpi_allreduce,
    mpi_allreduce_hier,
    ring,
    rows_wire,
)

from asynclock._core.base.header import COMPACT_BYTES, SLOT_BYTES

SCALES = ((64, 8), (512, 8))  # nodes x ranks per node for the predictions


MPI_NAMES = {"embedded": "MPICH", "system": "Open MPI"}
VALIDATE: tuple[tuple[str, int, int, int], ...] = (  # where, n, ppn, nodes
    ("local", 2, 2, 1), ("local", 4, 4, 1), ("local", 8, 8, 1),
    ("netrig", 2, 1, 2), ("netrig", 4, 2, 2))
Model = Callable[[Layout, Params], Cost]


def models_for(nbytes: int) -> dict[str, Model]:
    """Measured kind -> the model of it, for one size where a size applies."""
    return {
        "mpi_allreduce": lambda lay, p: mpi_allreduce(lay, nbytes, p),
        # asynclock's default path: the node window where it applies
        "asynclock_allreduce": lambda lay, p: asynclock_allreduce_hier(lay, nbytes, p),
    }


FIXED: dict[tuple[str, int], Model] = {
    ("mpi_iallreduce_compact", COMPACT_BYTES): compact_wire,
    ("mpi_iallgather_rows", SLOT_BYTES): rows_wire,
    ("mpi_allreduce_band", 8): lambda lay, p: hvd_negotiation(lay, p),
    ("hvd_miss_mpi", HVD_REQUEST_BYTES): lambda lay, p: hvd_negotiation_miss(lay, p),
}
def hvd_model(nbytes: int) -> Model:
    return lambda lay, p: hvd_allreduce_sync(lay, nbytes, p)


def model_of(kind: str, nbytes: int) -> Model | None:
    if (kind, nbytes) in FIXED:
        return FIXED[(kind, nbytes)]
    if kind == "horovod_allreduce":
        return hvd_model(nbytes)
    return models_for(nbytes).get(kind)


def rig_params(p: Params, where: str) -> Params:
    """On netrig both MPIs are told to use TCP only: ranks of one emulated host talk
    over TCP on loopback, not shared memory."""
    if where == "netrig" and p.loop is not None:
        return replace(p, shm=p.loop)
    return p


def validation(stored: dict[str, Any]) -> list[dict[str, Any]]:
    pts = Points(stored)
    out = []
    for mpi in ("embedded", "system"):
        p = fit(pts, mpi)
        if p is None:
            continue
        for where, n, ppn, nodes in VALIDATE:
            lay = Layout(nodes, ppn)
            for horovod in (False, True):
                job = pts.job(mpi, where, n, ppn, horovod)
                if job is None:
                    continue
                for r in job["rows"]:
                    model = model_of(r["kind"], r["bytes"])
                    if model is None:
                        continue
                    pred = model(lay, rig_params(p, where)).seconds
                    best = r.get("best", r["seconds"])
                    out.append({"mpi": mpi, "where": where, "layout": lay.label(), "ranks": n,
                                "kind": r["kind"], "bytes": r["bytes"],
                                "measured": r["seconds"], "best": best, "predicted": pred,
                                "error": (pred - r["seconds"]) / r["seconds"],
                                "error_best": (pred - best) / best})
    return out


def fmt_s(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_b(b: float) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:.0f} B"


KIND_TEXT = {
    "mpi_allreduce": "MPI_Allreduce", "asynclock_allreduce": "asynclock allreduce_",
    "mpi_iallreduce_compact": "compact round's MPI call (Iallreduce 160 B)",
    "mpi_iallgather_rows": "rows round's MPI call (Iallgather 272 B/rank)",
    "mpi_allreduce_band": "Horovod negotiation (Allreduce 8 B BAND)",
    "hvd_miss_mpi": "Horovod miss cycle (MPI calls)", "horovod_allreduce": "hvd.allreduce_",
}


def render_validation(rows: list[dict[str, Any]]) -> str:
    lines = ["| MPI | ranks | what | size | measured: median (best) | model | error: median "
             "(best) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        where = r["layout"] + (" (netrig)" if r["where"] == "netrig" else "")
        size = fmt_b(r["bytes"]) if r["kind"] in ("mpi_allreduce", "asynclock_allreduce",
                                                  "horovod_allreduce") else ""
        lines.append(f"| {MPI_NAMES[r['mpi']]} | {where} | {KIND_TEXT[r['kind']]} | {size} | "
                     f"{fmt_s(r['measured'])} ({fmt_s(r['best'])}) | {fmt_s(r['predicted'])} | "
                     f"{r['error'] * 100:+.0f}% ({r['error_best'] * 100:+.0f}%) |")
    return "\n".join(lines)


def render_params(ps: list[Params]) -> str:
    lines = ["| parameter | " + " | ".join(MPI_NAMES[p.mpi] for p in ps) + " |"]
    lines.append("| --- |" + " --- |" * len(ps))

    def row(name: str, get: Callable[[Params], str]) -> None:
        lines.append(f"| {name} | " + " | ".join(get(p) for p in ps) + " |")

    row("alpha shm: half round trip, 8 B, one node", lambda p: fmt_s(p.shm.alpha))
    for size in (64 << 10, 4 << 20, 64 << 20):
        row(f"shm bandwidth at {fmt_b(size)}", partial(_link_bw, "shm", size))
    row("alpha net: 8 B between netrig hosts", lambda p: fmt_s(p.net.alpha))
    for size in (64 << 10, 4 << 20, 64 << 20):
        row(f"net bandwidth at {fmt_b(size)}", partial(_link_bw, "net", size))
    row("alpha loop: 8 B, one netrig host (TCP)", lambda p: fmt_s(p.loop.alpha) if p.loop else "-")
    row("o: CPU per small message (stream)", lambda p: fmt_s(p.o_msg))
    row("o_eng: asynclock per checked call", lambda p: fmt_s(p.o_eng))
    row("o_stage: data stage from the call", lambda p: fmt_s(p.o_stage))
    row("o_bulk: wait-thread hand-off", lambda p: fmt_s(p.o_bulk))
    row("fresh memory: first touch per 4 KiB page", lambda p: fmt_s(p.fresh * 4096))
    for size in (64 << 10, 64 << 20):
        row(f"gamma: float32 sum at {fmt_b(size)}", partial(_rate_bw, "gamma", size))
        row(f"memcpy at {fmt_b(size)}", partial(_rate_bw, "copy", size))
    for size in (4 << 20, 64 << 20):
        row(f"sum, every core at once, at {fmt_b(size)}", partial(_rate_bw, "gamma_all", size))
        row(f"memcpy, every core at once, at {fmt_b(size)}", partial(_rate_bw, "copy_all", size))
    return "\n".join(lines)


def _link_bw(level: str, nbytes: int, p: Params) -> str:
    link: Link = getattr(p, level)
    return _bw(link.beta(nbytes))


def _rate_bw(what: str, nbytes: int, p: Params) -> str:
    rate: Rate | None = getattr(p, what)
    return _bw(rate.curve.at(nbytes)) if rate is not None else "-"


def _bw(beta: float) -> str:
    if beta <= 0:
        return "inf"
    gbs = 1 / beta / 1e9
    return f"{gbs:.2f} GB/s ({gbs * 8:.1f} Gbit/s)"


Sized = Callable[[Layout, int, Params], Cost]


def unsized(fn: Callable[[Layout, Params], Cost]) -> Sized:
    """A cost that does not depend on the message, as a row of the predictions."""
    return lambda lay, m, p: fn(lay, p)


# The predictions' rows; False: the cost does not depend on the message (one row).
SCALE_ROWS: tuple[tuple[str, Sized, bool], ...] = (
    ("asynclock check, after (compact)", unsized(check_after), False),
    ("asynclock check, before (rows every call)", unsized(check_before), False),
    ("asynclock check, ranks differ (compact + rows)", unsized(check_rows), False),
    ("asynclock allreduce, flat (ASYNCLOCK_NODE_WINDOW=0)", asynclock_allreduce, True),
    ("asynclock allreduce, node window from 1 MiB (default)", asynclock_allreduce_hier, True),
    ("MPI_Allreduce, flat", mpi_allreduce, True),
    ("MPI_Allreduce, node leaders", mpi_allreduce_hier, True),
    ("MPI_Allreduce, ring (latency bound at scale)", ring, True),
    ("Horovod negotiation, cache hit (per cycle)", unsized(hvd_negotiation), False),
    ("Horovod negotiation, miss (per cycle)", unsized(hvd_negotiation_miss), False),
    ("hvd.allreduce, synchronous", hvd_allreduce_sync, True),
)


def render_predictions(p: Params, layouts: Iterable[Layout]) -> str:
    lays = list(layouts)
    head = "| what | size | " + " | ".join(f"{lay.label()} ({lay.n})" for lay in lays) + " |"
    lines = [head, "| --- | --- |" + " --- |" * len(lays)]
    for name, fn, sized in SCALE_ROWS:
        for m in (SIZES if sized else (0,)):
            cells = [fn(lay, m, p) for lay in lays]
            lines.append(f"| {name} | {fmt_b(m) if m else '-'} | " + " | ".join(
                f"{fmt_s(c.seconds)}, {fmt_b(c.sent)}" for c in cells) + " |")
    return "\n".join(lines)


def assumed_net(spec: str) -> Link:
    """A network given as "ALPHA_US,GBIT" (a straight line, full duplex), for what-ifs."""
    alpha_us, gbit = (float(x) for x in spec.split(","))
    alpha, big = alpha_us * 1e-6, float(64 << 20)
    line = Curve(((8.0, alpha), (big, alpha + big * 8 / (gbit * 1e9))))
    return Link(line, line)


def report(stored: dict[str, Any], net: str | None = None) -> str:
    pts = Points(stored)
    ps = [p for p in (fit(pts, m) for m in ("embedded", "system")) if p is not None]
    if not ps:
        return "no parameters yet: run --measure local (and --measure netrig as root)"
    machine = stored.get("machine", {})
    out = [f"measured: {stored.get('measured', {})}, machine: {machine.get('host')} "
           f"({machine.get('cpus')} CPUs)",
           "\n## Parameters\n", render_params(ps),
           "\n## Validation: model vs measured (slowest rank's median per call)\n"]
    checked = validation(stored)
    cpus = int(machine.get("cpus") or 0)
    fits = [r for r in checked if r["ranks"] <= cpus]
    out += [f"\nOne rank per core or fewer ({cpus} cores):\n", render_validation(fits),
            f"\nMore ranks than the {cpus} cores (netrig's hosts share them too):\n",
            render_validation([r for r in checked if r["ranks"] > cpus])]
    where = "netrig's 5 Gbit/s TCP between nodes"
    if net is not None:
        ps = [replace(p, net=assumed_net(net)) for p in ps]
        where = f"an assumed network: {net.split(',')[0]} us, {net.split(',')[1]} Gbit/s"
    for p in ps:
        out += [f"\n## Predictions, {MPI_NAMES[p.mpi]} parameters ({where}): latency, "
                "bytes sent per rank\n",
                render_predictions(p, [Layout(8, 8)] + [Layout(*s) for s in SCALES])]
    return "\n".join(out)
