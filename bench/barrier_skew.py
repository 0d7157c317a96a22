"""When Horovod-style synchronous calls return, rank by rank: asynclock.torch vs Horovod.

Run: mpiexec -n 3 python bench/barrier_skew.py [--peer horovod] [--rounds 50] [--json PATH]

Each round is the pattern of Horovod's `test_global_barrier_op`: every rank
arrives at an allreduce at a random moment (up to `--arrival` seconds late),
then rank 0 sleeps `--sleep` seconds and every rank calls `barrier()`. All
ranks share one machine's clock, so rank 0 reports, per other rank:

* exit skew: when the allreduce returned there, minus when it returned on rank 0;
* release: when the barrier returned there, minus when rank 0 entered it;
* margin: the barrier's time there (from its allreduce's return) minus the
  sleep. Horovod's test asserts margin >= 0 on every rank; a rank whose
  allreduce returned later than rank 0's by more than its release time fails it,
  on any implementation;
* the process CPU time burnt per second of waiting in the barrier.

Start a CPU hog beside it (`python -c 'while 1: pass' &`) to see the ranks
scheduled late, as on a loaded CI machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import resource
import time
from typing import Any

import torch
from timing import median


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=("asynclock", "horovod"), default="asynclock")
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--sleep", type=float, default=0.5, help="rank 0's sleep before barrier")
    p.add_argument("--arrival", type=float, default=0.3, help="most a rank arrives late")
    p.add_argument("--json", help="write the figures here (rank 0)")
    return p.parse_args()


def cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def main() -> None:
    args = parse()
    hvd: Any = importlib.import_module("horovod.torch" if args.peer == "horovod"
                                       else "asynclock.torch")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rng = random.Random(rank * 7919 + 1)
    rounds: list[tuple[float, float, float, float, float]] = []
    for i in range(args.rounds):
        time.sleep(rng.random() * args.arrival)
        hvd.allreduce_(torch.IntTensor([1]), None, f"arrive{i}", hvd.Sum)
        returned = time.time()
        if rank == 0:
            time.sleep(args.sleep)
        entered, cpu = time.time(), cpu_s()
        hvd.barrier()
        rounds.append((returned, entered, time.time(), cpu_s() - cpu, args.sleep))
    every = hvd.allgather_object(rounds)
    if rank == 0:
        report(args, every, size)
    hvd.shutdown()


def report(args: argparse.Namespace, every: list[Any], size: int) -> None:
    ms = 1e3
    figures: dict[str, Any] = {"peer": args.peer, "ranks": size, "rounds": args.rounds,
                               "sleep_s": args.sleep, "per_rank": {}}
    for k in range(1, size):
        mine, zero = every[k], every[0]
        skew = [(mine[i][0] - zero[i][0]) * ms for i in range(args.rounds)]
        release = [(mine[i][2] - zero[i][1]) * ms for i in range(args.rounds)]
        margin = [(mine[i][2] - mine[i][0] - args.sleep) * ms for i in range(args.rounds)]
        cpu = sum(r[3] for r in mine) / sum(r[2] - r[1] for r in mine)
        row = {"exit_skew_ms": [round(min(skew), 2), round(median(skew), 2),
                                round(max(skew), 2)],
               "release_ms_median": round(median(release), 2),
               "margin_ms_min": round(min(margin), 2),
               "short": sum(m < 0 for m in margin),
               "cpu_per_wait_s": round(cpu, 3)}
        figures["per_rank"][k] = row
        print(f"{args.peer} rank {k}: exit skew min/median/max {row['exit_skew_ms']} ms; "
              f"barrier release {row['release_ms_median']} ms after rank 0 entered (median); "
              f"margin min {row['margin_ms_min']} ms, short {row['short']}/{args.rounds}; "
              f"CPU {row['cpu_per_wait_s']:.3f} s per s waiting", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
