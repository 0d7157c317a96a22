"""Overlap plot: per rank, compute vs communication over a few steps.

    python -m asynclock.plot run.json -o overlap.png [--steps 3] [--ranks 8]

One row per rank: a lane of compute slices, a lane of communication
(collectives, bucket traffic), a lane of lock waits when there are any,
and in red the communication no compute hid, i.e. what the step paid for.
The title gives that exposed time as a fraction of the step time, computed
by the same interval math as the live `asynclock.metrics` numbers.
A timeline prefix works too (its rank files are merged first).
matplotlib is imported only when plotting, with the Agg backend (no display).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .metrics import RankTracks, StepMetrics, clip, difference, measure, total, tracks, union

Event = dict[str, Any]
LANES = (("compute", "#4c72b0"), ("comm", "#dd8452"), ("exposed comm", "#c44e52"),
         ("lock wait", "#8c8c8c"))


def load(path: str | Path) -> list[Event]:
    """Events of a merged trace (object or array form), or of a prefix's rank files."""
    p = Path(path)
    if not p.is_file():
        from . import timeline

        p = timeline.merge(path).path
    with open(p) as f:
        doc = json.load(f)
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    return [e for e in events if isinstance(e, dict)]


def chosen_steps(tr: RankTracks, count: int) -> list[tuple[float, float]]:
    """The last `count` step slices (the first steps are warm-up); the whole run if none."""
    steps = sorted((lo, hi) for lo, hi, _ in tr.steps)
    return steps[-count:] if steps else [tr.window()]


def summarize(tr: RankTracks, steps: list[tuple[float, float]]) -> StepMetrics:
    """One StepMetrics over the chosen steps together (µs in, seconds out)."""
    per = [measure(i, lo, hi, tr.compute, tr.comm, unit=1e-6) for i, (lo, hi) in enumerate(steps)]
    step_s = sum(m.step_time_s for m in per)
    comm_s = sum(m.comm_s for m in per)
    exposed_s = sum(m.exposed_comm_s for m in per)
    hidden = comm_s - exposed_s
    lock_s = sum(total(clip(tr.sync, a, b)) for a, b in steps) * 1e-6
    return StepMetrics(len(per), step_s, sum(m.compute_s for m in per), comm_s, exposed_s,
                       100.0 * hidden / comm_s if comm_s > 0 else 0.0,
                       exposed_s / step_s if step_s > 0 else 0.0, lock_wait_s=lock_s)


def _lanes(tr: RankTracks, lo: float, hi: float) -> list[list[tuple[float, float]]]:
    """Clipped (start, width) bars in ms from `lo`, one list per entry of LANES."""
    compute, comm = union(clip(tr.compute, lo, hi)), union(clip(tr.comm, lo, hi))
    rows = [compute, comm, difference(comm, compute), union(clip(tr.sync, lo, hi))]
    return [[((a - lo) / 1e3, (b - a) / 1e3) for a, b in row] for row in rows]


def _draw_rank(ax: Any, rank: int, tr: RankTracks, steps: list[tuple[float, float]]) -> None:
    lo, hi = steps[0][0], steps[-1][1]
    rows = _lanes(tr, lo, hi)
    shown = [i for i, bars in enumerate(rows) if bars or i < 3]
    for y, i in enumerate(reversed(shown)):
        ax.broken_barh(rows[i], (y + 0.1, 0.8), color=LANES[i][1], label=LANES[i][0])
    for a, _ in steps[1:]:
        ax.axvline((a - lo) / 1e3, color="black", lw=0.6, ls=":")
    ax.set_yticks([y + 0.5 for y in range(len(shown))], [LANES[i][0] for i in reversed(shown)])
    ax.set_xlim(0, (hi - lo) / 1e3)
    m = summarize(tr, steps)
    ax.set_title(f"rank {rank}: exposed communication {100 * m.exposed_fraction:.1f}% of step "
                 f"time ({m.exposed_comm_s * 1e3:.1f} of {m.step_time_s * 1e3:.1f} ms; "
                 f"{m.overlap_pct:.0f}% of comm hidden)", fontsize=9, loc="left")


def plot(events: list[Event], out: str | Path, steps: int = 3,
         max_ranks: int = 8) -> dict[int, StepMetrics]:
    """Write the overlap figure to `out` (PNG, SVG, PDF by suffix); metrics per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_rank = dict(list(tracks(events).items())[:max_ranks])
    if not per_rank:
        raise ValueError("the trace has no compute or communication slices to plot")
    fig, axes = plt.subplots(len(per_rank), 1, squeeze=False,
                             figsize=(11, 0.9 + 1.6 * len(per_rank)))
    result = {}
    for ax, (rank, tr) in zip(axes[:, 0], per_rank.items(), strict=True):
        chosen = chosen_steps(tr, steps)
        _draw_rank(ax, rank, tr, chosen)
        result[rank] = summarize(tr, chosen)
    axes[-1, 0].set_xlabel("time since the first plotted step (ms); dotted: step boundaries")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    mean = sum(m.exposed_fraction for m in result.values()) / len(result)
    fig.suptitle(f"compute vs communication, last {steps} step(s): exposed communication "
                 f"{100 * mean:.1f}% of step time (mean over ranks)", fontsize=10, x=0.01,
                 ha="left")
    fig.tight_layout(rect=(0, 0.04, 1, 0.96))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asynclock.plot", description=__doc__.split("\n")[0])
    p.add_argument("trace", help="merged timeline JSON, or a timeline prefix")
    p.add_argument("-o", "--output", default="overlap.png")
    p.add_argument("--steps", type=int, default=3, help="plot the last N step slices")
    p.add_argument("--ranks", type=int, default=8, help="plot at most this many ranks")
    args = p.parse_args(argv)
    try:
        result = plot(load(args.trace), args.output, args.steps, args.ranks)
    except (OSError, ValueError) as exc:
        print(f"asynclock.plot: {exc}", file=sys.stderr)
        return 1
    for rank, m in result.items():
        print(f"rank {rank}: exposed {100 * m.exposed_fraction:.1f}% of {m.step_time_s * 1e3:.1f}"
              f" ms over {m.step} step(s), {m.overlap_pct:.0f}% of comm hidden")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
