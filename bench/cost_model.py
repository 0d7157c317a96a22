"""A cost model of a checked collective, to 4096 ranks: asynclock's check and data
path, Horovod's negotiation and raw MPI allreduce, as functions of the ranks
(nodes x ranks per node), the message size and measured parameters.

    python bench/cost_model.py                    # tables from bench/cost_params.json
    python bench/cost_model.py --measure local    # parameters and points on this machine
    python bench/cost_model.py --measure netrig   # the same across netrig hosts (root)
    python bench/cost_model.py probe ...          # the rank program the two above launch

The model is Hockney's, with each link's cost taken by message size from
measurements (a one-way message and an exchange) instead of one straight
line alpha + beta*m. Formulas, parameters and the validation:
docs/design/cost_model.md. This file is the command line; the rest is one module
per idea, beside it:

    cost_formulas.py   the model: parameters, layouts, one function per algorithm
    cost_probe.py      the rank program (`probe`): times MPI, asynclock and Horovod
    cost_measure.py    runs the probes here or on netrig, times memory, stores runs
    cost_fit.py        the parameters, fitted to the stored runs
    cost_report.py     the tables: parameters, validation, predictions
"""

from __future__ import annotations

import argparse
import sys

from cost_formulas import SIZES
from cost_measure import PARAMS_JSON, load, measure
from cost_probe import probe
from cost_report import report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("mode", nargs="?", choices=("report", "probe"), default="report")
    p.add_argument("--measure", choices=("local", "netrig", "machine"),
                   help="machine: one core's memory figures only")
    p.add_argument("--net", metavar="ALPHA_US,GBIT",
                   help="predict for this network between nodes instead of netrig's")
    p.add_argument("--params", default=str(PARAMS_JSON))
    p.add_argument("--mpis", default="embedded,system")
    p.add_argument("--link", default="5gbit", help="netrig link rate")
    p.add_argument("--rounds", type=int, default=15, help="timed batches per figure and job")
    p.add_argument("--repeat", type=int, default=3, help="jobs per configuration (median)")
    p.add_argument("--round-s", type=float, default=0.03)
    p.add_argument("--job-timeout", type=float, default=240.0)
    p.add_argument("--skip-horovod", action="store_true")
    p.add_argument("--quiet-s", type=float, default=60.0,
                   help="wait up to this long for an idle machine before each job")
    # probe only
    p.add_argument("--json", default="cost_probe.json")
    p.add_argument("--sizes", default=",".join(map(str, SIZES[:3])))
    p.add_argument("--horovod", action="store_true")
    p.add_argument("--p2p", action="store_true", help="ping-pong and message stream too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.mode == "probe":
        probe(args)
        return 0
    if args.measure:
        measure(args)
    print(report(load(args.params), args.net))
    return 0


if __name__ == "__main__":
    sys.exit(main())
