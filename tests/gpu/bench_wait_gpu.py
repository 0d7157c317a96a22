"""How should a task await GPU work? Polling vs a helper thread vs blocking.

For GPU waits of several lengths (a spin kernel on a side stream), repeated
`--reps` times, medians of:

* wake_us: wall time from launch until the awaiting task resumes, minus the
  kernel's own duration (CUDA timing events): the wake-up latency;
* cpu_pct: process CPU time / wall time during the wait, all threads
  (a helper thread spinning in the driver shows up here);
* ticks: how often a 1 ms side task ran meanwhile (0: the loop was blocked).

Modes: `auto` (asynclock's default: tight polling, then the helper thread),
`poll`, `thread` (helper thread synchronizing a blocking-sync event, as
`cuda.record` makes), `thread-spin` (same with a default event: CUDA spins
the helper's core), `block` (event.synchronize() on the loop: what asynclock
must never do; the reference for latency).

    python tests/gpu/bench_wait_gpu.py [--reps 15]
    python tests/gpu/bench_wait_gpu.py --emulate   # no GPU: time-based events, policy costs only

`--emulate` replaces the kernel with an event that completes at a wall-clock
deadline (`synchronize()` sleeps until it; the spin variant burns the core
with GIL-free sleep(0) calls), which isolates what the waiting policy itself
costs; driver effects (cudaEventQuery cost, blocking-sync wake-up) need a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch
from gpu_util import gpu_sleep

from asynclock import cuda
from asynclock._core.device.waiting import WaitPolicy

LENGTHS_MS = (0.05, 1.0, 10.0, 50.0)
MODES = ("auto", "poll", "thread", "thread-spin", "block")


class TimedEvent:
    """The event protocol, completing at a wall-clock deadline (for --emulate)."""

    def __init__(self, length_ms: float, spin: bool) -> None:
        self.deadline = time.perf_counter() + length_ms / 1e3
        self.spin = spin
        self.asynclock_blocking = not spin

    def query(self) -> bool:
        return time.perf_counter() >= self.deadline

    def synchronize(self) -> None:
        while (left := self.deadline - time.perf_counter()) > 0:
            time.sleep(0 if self.spin else left)


EMULATE = False


def launch(length_ms: float, side: Any, blocking: bool) -> tuple[Any, Any, Any]:
    if EMULATE:
        return None, length_ms, TimedEvent(length_ms, spin=not blocking)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record()
        gpu_sleep(length_ms)
        end.record()
    done = cuda.record(side) if blocking else side.record_event()  # marked blocking-sync, or not
    return start, end, done


async def await_done(mode: str, done: Any) -> None:
    if mode == "block":
        done.synchronize()
    else:
        await cuda.wait(done, policy=WaitPolicy(mode="thread" if mode == "thread-spin" else mode))


async def one(mode: str, length_ms: float, side: Any) -> tuple[float, float, int]:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.001)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.002)
        ticks = 0
        wall0, cpu0 = time.perf_counter(), time.process_time()
        start, end, done = launch(length_ms, side, blocking=mode != "thread-spin")
        await await_done(mode, done)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        tg.cancel_scope.cancel()
    kernel_s = (end if EMULATE else start.elapsed_time(end)) / 1e3
    return (wall - kernel_s) * 1e6, 100 * cpu / wall, ticks


def med(xs: list[float]) -> float:
    return statistics.median(xs)


async def run(reps: int, emit: Callable[[str], None]) -> None:
    side = None
    if not EMULATE:
        side = torch.cuda.Stream()
        gpu_sleep(1.0)
        torch.cuda.synchronize()
    emit(f"{'mode':<12} {'gpu_ms':>7} {'wake_us':>9} {'cpu_pct':>8} {'ticks':>6}")
    for length in LENGTHS_MS:
        for mode in MODES:
            rows = [await one(mode, length, side) for _ in range(reps)]
            wake, cpu, ticks = (med([r[i] for r in rows]) for i in range(3))
            emit(f"{mode:<12} {length:>7.2f} {wake:>9.0f} {cpu:>8.1f} {ticks:>6.0f}")
            tag = "bench_wait_emulated" if EMULATE else "bench_wait"
            print(f"SUMMARY {tag} mode={mode} gpu_ms={length} wake_us={wake:.0f} "
                  f"cpu_pct={cpu:.1f} ticks={ticks:.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--emulate", action="store_true", help="no GPU: time-based events")
    args = parser.parse_args()
    global EMULATE
    EMULATE = args.emulate
    if not EMULATE and not torch.cuda.is_available():
        raise SystemExit("bench_wait_gpu: no CUDA device (use --emulate for the policy alone)")
    where = "emulated events" if EMULATE else torch.cuda.get_device_name()
    print(f"{where}; torch {torch.__version__}; medians of {args.reps}", flush=True)
    anyio.run(run, args.reps, lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
