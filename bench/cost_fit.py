"""Fitting bench/cost_model.py's parameters to the stored measurements: the links
from ping-pongs and exchanges, the memory rates from one core's copy and sum, the
engine's costs from 1-rank jobs.
"""

from __future__ import annotations

from typing import Any

from cost_formulas import Curve, Link, Params, Rate
from cost_measure import job_key
from cost_probe import P2P_SIZES

from asynclock._core.base.header import COMPACT_BYTES


class Points:
    """The measured rows of every job, looked up by job and kind."""

    def __init__(self, stored: dict[str, Any]) -> None:
        self.jobs: list[dict[str, Any]] = stored.get("jobs", [])
        self.machine: list[dict[str, Any]] = stored.get("machine", {}).get("rows", [])

    def job(self, kind: str, where: str, n: int, ppn: int,
            horovod: bool = False) -> dict[str, Any] | None:
        return next((j for j in self.jobs if job_key(j["meta"]) == (where, kind, n, ppn, horovod)),
                    None)

    def get(self, job: dict[str, Any] | None, kind: str, nbytes: int | None = None,
            where: str | None = None) -> float | None:
        """A parameter's figure: the best of the job's runs (another process on the
        shared cores only ever adds time; the parameters describe the machine)."""
        if job is None:
            return None
        for r in job["rows"]:
            if r["kind"] == kind and (nbytes is None or r["bytes"] == nbytes) and (
                    where is None or r.get("where") == where):
                return float(r.get("best", r["seconds"]))
        return None


def fit_link(pts: Points, job: dict[str, Any] | None, where: str) -> Link | None:
    """Half the ping-pong's round trip, and the exchange, at each measured size."""
    curves = []
    for kind in ("pingpong", "exchange"):
        found = [(float(b), pts.get(job, kind, b, where)) for b in P2P_SIZES]
        points = tuple((b, t) for b, t in found if t is not None)
        if len(points) < 2:
            return None
        curves.append(Curve(points))
    return Link(*curves)


def fit_rate(pts: Points, kind: str) -> Rate | None:
    points = tuple((float(r["bytes"]), r["seconds"] / r["bytes"])
                   for r in pts.machine if r["kind"] == kind)
    return Rate(Curve(tuple(sorted(points)))) if points else None


def fit(pts: Points, mpi: str) -> Params | None:
    """One MPI's parameters: links from ping-pongs (2 ranks on this machine, 2 netrig
    hosts), the engine's costs from 1-rank jobs, memory from one core."""
    one = pts.job(mpi, "local", 1, 1)
    two = pts.job(mpi, "local", 2, 2)
    shm = fit_link(pts, two, "intra")
    net = fit_link(pts, pts.job(mpi, "netrig", 2, 1), "inter")
    loop = fit_link(pts, pts.job(mpi, "netrig", 4, 2), "intra")
    copy, gamma = fit_rate(pts, "memcpy"), fit_rate(pts, "sum_f32")
    if one is None or shm is None or copy is None or gamma is None:
        return None

    def at_one(kind: str, nbytes: int) -> float:
        return pts.get(one, kind, nbytes) or 0.0

    a4 = at_one("asynclock_allreduce", 4)
    stage = at_one("asynclock_allreduce", 64 << 10) - a4 - at_one("mpi_allreduce", 64 << 10)
    bulk = at_one("asynclock_allreduce", 4 << 20) - a4 - at_one("mpi_allreduce", 4 << 20)
    fresh = next((r["seconds"] / r["bytes"] for r in pts.machine
                  if r["kind"] == "fresh_memory"), 0.0)
    return Params(mpi=mpi, shm=shm, net=net or shm, gamma=gamma, copy=copy, fresh=fresh,
                  copy_all=fit_rate(pts, "memcpy_all_cores"),
                  gamma_all=fit_rate(pts, "sum_f32_all_cores"),
                  o_msg=pts.get(two, "stream", 8, "intra") or 0.0,
                  o_eng=max(0.0, a4 - at_one("mpi_iallreduce_compact", COMPACT_BYTES)),
                  o_stage=max(0.0, stage), o_bulk=max(0.0, bulk), loop=loop)
