"""The async API in one screen: collectives and a side task on one event loop.

Run: bash launch/run.sh 2 examples/quickstart.py   (or mpiexec -n 2 python ...)
"""

from __future__ import annotations

import anyio
import torch

import asynclock


async def heartbeat(rank: int, ticks: list[int]) -> None:
    """A side task: keeps running while the collectives are in flight."""
    while True:
        ticks[0] += 1
        await anyio.sleep(0.001)


async def main() -> None:
    async with asynclock.start() as coord:
        ticks = [0]
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat, coord.rank, ticks)
            mine = torch.full((4,), float(coord.rank + 1))
            total = await coord.allreduce(mine)                    # sum over ranks
            mean = await coord.allreduce(mine, asynclock.Average)
            handles = [coord.allreduce_async(torch.ones(1000) * i) for i in range(50)]
            results = [await h for h in handles]                   # 50 in flight at once
            gathered = await coord.allgather_object({"rank": coord.rank, "sum": total[0].item()})
            await coord.barrier()
            tg.cancel_scope.cancel()
        in_flight_ok = all(r[0].item() == i * coord.size for i, r in enumerate(results))
        print(f"[rank {coord.rank}/{coord.size}] sum={total.tolist()} mean={mean[0].item():.2f} "
              f"50 in-flight ok={in_flight_ok} side-task ticks={ticks[0]}", flush=True)
        if coord.rank == 0:
            print(f"summary: {coord.size} ranks on {coord.backend.describe()}; "
                  f"every rank saw {gathered}", flush=True)


if __name__ == "__main__":
    anyio.run(main)
