"""Soak: many small steps; memory and in-flight structures must stay flat.

Run: mpiexec -n 2 python bench/soak.py [--steps 10000] [--warmup 1000] [--idle 20]
     [--trio] [--no-lock] [--json PATH]

Each step is an allreduce of a small tensor, a barrier and, when the
coordinator has cross-rank locks, one acquire/release of a shared lock.
Reported (rank 0 prints, every rank measures):

* step time (median, p99) and steps per second;
* resident memory (RSS) after the warm-up and at the end, and its growth;
  Python objects tracked by the GC at the same two points;
* what is still in flight after the run: engine ops, lane FIFOs, watchdog
  heartbeat sends (all must be 0 or near it);
* an idle phase (`--idle` s, nothing in flight, the loop asleep): CPU of the
  watchdog thread alone and of the whole process, as % of one core.

The heartbeat figures come from the watchdog's own thread CPU clock, so they
are not blurred by the progress engine or by other processes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import anyio
import numpy as np
from timing import median, percentile

import asynclock

PAGE = os.sysconf("SC_PAGE_SIZE")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--warmup", type=int, default=1_000)
    p.add_argument("--idle", type=float, default=20.0, help="idle phase length, s")
    p.add_argument("--trio", action="store_true")
    p.add_argument("--no-lock", action="store_true", help="leave the cross-rank lock out")
    p.add_argument("--json", help="write the figures here (rank 0)")
    return p.parse_args()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def snapshot() -> dict[str, float]:
    gc.collect()
    return {"rss_mib": rss_mib(), "gc_objects": float(len(gc.get_objects()))}


async def step(c: asynclock.Coordinator, x: Any, lock: Any) -> None:
    total = await c.allreduce(x, name="soak")
    assert total[0] == c.size, total
    await c.barrier()
    if lock is not None:
        async with lock:
            pass


async def run_steps(c: asynclock.Coordinator, args: argparse.Namespace) -> dict[str, Any]:
    x = np.ones(16, np.float32)
    lock = c.lock("soak") if hasattr(c, "lock") and not args.no_lock else None
    times: list[float] = []
    before: dict[str, float] = {}
    for i in range(args.steps):
        if i == args.warmup:
            before = snapshot()
        t0 = time.perf_counter()
        await step(c, x, lock)
        times.append(time.perf_counter() - t0)
    await c.drain()
    after = snapshot()
    return {"before": before, "after": after, "times": times, "lock": lock is not None}


def in_flight(c: asynclock.Coordinator) -> dict[str, Any]:
    wd = c.lowlevel.watchdog.statistics() if c.lowlevel.watchdog is not None else None
    return {"engine_ops": c.statistics().in_flight,
            "lane_fifos": [len(lane.queue) for lane in c.lowlevel.engine.lanes],
            "watchdog_pending_sends": wd.pending_sends if wd else None,
            "heartbeats_sent": wd.heartbeats_sent if wd else None,
            "heartbeats_received": wd.heartbeats_received if wd else None}


async def idle_cpu(c: asynclock.Coordinator, seconds: float) -> dict[str, float]:
    """Both clocks over an idle stretch: the loop sleeps, nothing is in flight."""
    await c.barrier()
    wd0 = c.lowlevel.watchdog.statistics().cpu_s if c.lowlevel.watchdog is not None else 0.0
    p0, t0 = time.process_time(), time.perf_counter()
    await anyio.sleep(seconds)
    wall = time.perf_counter() - t0
    await anyio.sleep(0.6)  # the watchdog's cpu figure is refreshed once per heartbeat
    wd1 = c.lowlevel.watchdog.statistics().cpu_s if c.lowlevel.watchdog is not None else 0.0
    return {"wall_s": wall, "watchdog_pct": 100 * (wd1 - wd0) / wall,
            "process_pct": 100 * (time.process_time() - p0) / wall}


def summarise(rank_rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    me = rank_rows[0]
    times = me["times"]
    return {
        "ranks": len(rank_rows), "steps": args.steps, "warmup": args.warmup, "lock": me["lock"],
        "step_median_us": 1e6 * median(times),
        "step_p99_us": 1e6 * percentile(times, 0.99),
        "steps_per_s": len(times) / sum(times),
        "per_rank": [{k: r[k] for k in ("before", "after", "in_flight", "idle")}
                     for r in rank_rows],
    }


def render(s: dict[str, Any]) -> str:
    what = "allreduce(16 x f32) + barrier" + (" + lock" if s["lock"] else "")
    lines = [f"soak: {s['ranks']} ranks, {s['steps']} steps of {what}, warm-up {s['warmup']}",
             f"step: median {s['step_median_us']:.0f} us, p99 {s['step_p99_us']:.0f} us, "
             f"{s['steps_per_s']:.0f} steps/s (rank 0)",
             "rank | RSS warm MiB | RSS end MiB | growth | GC objs warm | GC objs end | "
             "in flight (engine, FIFOs, hb sends) | idle CPU: watchdog | process"]
    for r, row in enumerate(s["per_rank"]):
        b, a, f, i = row["before"], row["after"], row["in_flight"], row["idle"]
        growth = 100 * (a["rss_mib"] / b["rss_mib"] - 1)
        lines.append(
            f"{r:4d} | {b['rss_mib']:12.1f} | {a['rss_mib']:11.1f} | {growth:+5.2f}% | "
            f"{b['gc_objects']:12.0f} | {a['gc_objects']:11.0f} | "
            f"{f['engine_ops']}, {f['lane_fifos']}, {f['watchdog_pending_sends']} | "
            f"{i['watchdog_pct']:.3f}% | {i['process_pct']:.2f}%")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    async with asynclock.start() as c:
        row = await run_steps(c, args)
        row["in_flight"] = in_flight(c)
        row["idle"] = await idle_cpu(c, args.idle)
        rows = await c.allgather_object(row, name="soak-figures")
        if c.rank == 0:
            summary = summarise(rows, args)
            print(render(summary), flush=True)
            if args.json:
                for r in summary["per_rank"]:
                    r.pop("times", None)
                with open(args.json, "w") as f:
                    json.dump(summary, f, indent=2)


if __name__ == "__main__":
    ns = parse()
    anyio.run(main, ns, backend="trio" if ns.trio else "asyncio")
