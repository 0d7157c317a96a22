"""Recovery time of an elastic job: from a rank's death to the first step of the new world.

Run (under the bench lock: every rank and horovodrun share the machine's cores):

    flock /tmp/asynclock-bench.lock python bench/elastic.py [--runs 3] [--json PATH]

The job is tests/programs/elastic_train.py under `horovodrun --gloo -np 3 --min-np 2
--max-np 3` with a host discovery script: three single-slot "hosts" that are names
of this machine (`localhost`, `127.0.0.1`, `127.1`), a small float64 model, a
commit every 3 steps; rank 2 SIGKILLs itself in step 8 and prints the time first.
Each survivor prints the time its first step in the 2-rank world completed; the
recovery is the later of the two minus the death. Two programs, the same job shape:

* asynclock: `import asynclock.torch as hvd` (`hvd.elastic.run`, `TorchState`,
  `DistributedOptimizer`), the default under `--api hvd`;
* horovod: the same code on `horovod.torch` (`--api horovod`).

Runs alternate between the two; the medians and every run's figure are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import median

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "programs" / "elastic_train.py"
HOSTS = ("localhost", "127.0.0.1", "127.1")
_AT = re.compile(r"RANK (\d+) OK (died|world) (?:size=(\d+) )?.*?at=([\d.]+)")


def one_run(api: str, timeout: float) -> float:
    """One job; the seconds from rank 2's death to the new world's first step."""
    with tempfile.TemporaryDirectory(prefix="asynclock-elastic-") as tmp:
        work = Path(tmp)
        (work / "hosts").write_text("".join(f"{h}:1\n" for h in HOSTS))
        script = work / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {work / 'hosts'}\n")
        script.chmod(0o755)
        cmd = [str(Path(sys.executable).with_name("horovodrun")), "--gloo", "-np", "3",
               "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script),
               "--network-interface", "lo", sys.executable, str(PROGRAM), str(work),
               "--api", api]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT)
    died, firsts = [], []
    for m in _AT.finditer(done.stdout):
        if m[2] == "died":
            died.append(float(m[4]))
        elif m[3] == "2":
            firsts.append(float(m[4]))
    if done.returncode != 0 or len(died) != 1 or len(firsts) != 2:
        raise RuntimeError(f"{api} run failed (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return max(firsts) - died[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--apis", default="hvd,horovod", help="hvd (asynclock), horovod")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    apis = args.apis.split(",")
    seconds: dict[str, list[float]] = {api: [] for api in apis}
    for run in range(args.runs):
        for api in apis:
            t0 = time.monotonic()
            seconds[api].append(one_run(api, args.timeout))
            print(f"run {run + 1} {api}: recovery {seconds[api][-1]:.2f} s "
                  f"(job {time.monotonic() - t0:.0f} s)", flush=True)
    names = {"hvd": "asynclock (hvd.elastic)", "horovod": "Horovod 0.28.1 elastic"}
    for api in apis:
        runs = ", ".join(f"{s:.2f}" for s in seconds[api])
        print(f"{names.get(api, api)}: median {median(seconds[api]):.2f} s "
              f"(runs: {runs})")
    if args.json is not None:
        args.json.write_text(json.dumps(seconds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
