"""asynclock-launch: run one program on N ranks with whichever launcher fits.

    python -m asynclock.launch -n 2 train.py --epochs 3
    asynclock-launch -n 4 --runner horovodrun --gloo train.py
    asynclock-launch -n 2 --timeline /tmp/run/tl --timeout 600 train.py
    asynclock-launch --elastic --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh train.py

Why a launcher of our own: the two MPIs on a machine must never be mixed
(`_tools.mpi_select`, the kit's `mpi/mpi_select.py`, hands out launcher and
environment together); Horovod, Slurm and plain MPI spell ranks, hosts and
output tags differently; and a hung job must die as a whole. So this module
picks the runner (`srun` under Slurm, `horovodrun` on request, else the
project's MPI), forwards the environment, kills the whole process group on
`--timeout`, returns non-zero when any rank failed, and merges `--timeline`
files at the end, even after a failure.

Each rank starts behind `asynclock/_tools/rank_output.py`, which tags whole output
lines `[r] line` (the runners' own tags split lines) and announces a rank
that failed, so a runner that never notices still ends (see that module).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ._tools import mpi_select
from ._tools.rank_output import env_rank as env_rank  # re-exported: the launchers' rank variables
from ._tools.rank_output import env_size as env_size
from ._tools.rank_output import trampoline
from .jobwatch import FAILURE_GRACE_S, run_job
from .jobwatch import TIMEOUT_EXIT as TIMEOUT_EXIT  # re-exported for callers and tests
from .jobwatch import strip_tag as strip_tag

RUNNERS = ("auto", "mpiexec", "embedded", "system", "horovodrun", "srun")
# Variables Open MPI must be told to forward (-x): local ranks inherit, remote ones do not.
FORWARD_PREFIXES = ("ASYNCLOCK_", "PYTHON", "MPI4PY_", "OMP_", "HOROVOD_", "NCCL_", "CUDA_",
                    "TORCH", "LD_LIBRARY_PATH", "PATH", "VIRTUAL_ENV")
# The srun plugin that wires up each of the project's MPIs (`srun --mpi=list`): Debian's
# Open MPI is built against PMIx; MPICH speaks PMI-1/PMI-2 only, aborts in MPI_Init under
# pmix ("unsupported PMI version PMIx"), and under `--mpi=none` every rank is a singleton.
SRUN_PLUGINS = {"Open MPI": "pmix", "MPICH": "pmi2"}
_HOST_FLAGS = {"hydra": ("-hosts", "-f"), "openmpi": ("--host", "--hostfile"),
               "horovodrun": ("-H", "--hostfile"), "srun": ("--nodelist", "--nodelist")}


# -- the project's MPIs -----------------------------------------------------------------
def kit_environ(kind: str) -> dict[str, str] | None:
    """The environment for the project's MPI `kind` (`_tools.mpi_select`), or None where
    `auto` finds none of the project's MPIs here (an installed wheel beside an MPI of
    the user's own: the caller then takes that one from PATH). An MPI asked for by
    name and missing raises, naming what to install."""
    if kind == "auto" and not mpi_select.describe(kind)["available"]:
        return None
    return mpi_select.environ_for(kind)


# -- the plan: argv and environment ----------------------------------------------------
@dataclass
class Plan:
    """What to run: the runner's argv and full environment."""

    runner: str
    argv: list[str]
    env: dict[str, str]
    strip_tags: bool = False  # horovodrun: drop its own tags (ours are already there)
    temp_files: list[str] = field(default_factory=list)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asynclock-launch", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("-n", "-np", dest="nranks", type=int, default=None,
        help="number of ranks (default: SLURM_NTASKS under Slurm, else 1)")
    add("--runner", choices=RUNNERS, default="auto",
        help="auto: srun under Slurm, horovodrun with --gloo, else the project's MPI")
    add("--mpi", choices=("auto", "embedded", "system"), default=None,
        help="which MPI (mpi/mpi_select.py); default: auto or $ASYNCLOCK_MPI")
    add("--gloo", action="store_true", help="horovodrun with its Gloo controller")
    add("--elastic", action="store_true",
        help="an elastic job: horovodrun --gloo with --min-np/--max-np; ranks that die or "
             "are cut off leave the job, hosts the discovery script adds join it")
    add("--min-np", type=int, default=None, help="elastic: the fewest ranks the job runs on")
    add("--max-np", type=int, default=None, help="elastic: the most ranks the job runs on")
    add("--host-discovery-script", metavar="SCRIPT",
        help="elastic: prints 'host:slots' lines, run every second by horovodrun")
    add("-H", "--hosts", help="host:slots,host:slots")
    add("--hostfile", help="'host slots=N' or 'host:N' lines; converted for the runner")
    add("--timeout", type=float, default=None, help="kill the whole job after S seconds")
    add("--failure-grace", type=float, default=FAILURE_GRACE_S, metavar="S",
        help="kill the job when the runner outlives a rank's 'stopping the job' by S "
             "seconds (hydra never returns after a host is cut off)")
    add("--timeline", metavar="PREFIX", help="record a timeline; merged at the end")
    add("--no-prefix", action="store_true", help="do not tag output lines with [rank]")
    add("-x", "--env", action="append", default=[], metavar="NAME[=VALUE]",
        help="set and forward an environment variable to every rank")
    add("--launcher-arg", action="append", default=[], metavar="ARG",
        help="extra argument passed to the runner verbatim")
    add("--dry-run", action="store_true", help="print the command and exit")
    # A flag, as torchrun's: the module is the program's first word, so whatever follows
    # it (`-m pkg.train --timeout 5 -n 3`) is the module's, as after `python -m`.
    add("-m", "--module", action="store_true",
        help="the program is a python module: -m pkg.train args... (like python -m)")
    add("program", nargs=argparse.REMAINDER, help="script.py args... or any command")
    args = p.parse_args(argv)
    if args.program[:1] == ["--"]:
        args.program = args.program[1:]
    if not args.program:
        p.error("give a module: asynclock-launch -n 2 -m pkg.train [args...]" if args.module
                else "give a program: asynclock-launch -n 2 train.py [args...]")
    elastic_only = [flag for flag, value in (("--min-np", args.min_np), ("--max-np", args.max_np),
                    ("--host-discovery-script", args.host_discovery_script)) if value is not None]
    if elastic_only and not args.elastic:
        p.error(f"{', '.join(elastic_only)}: only with --elastic")
    if args.elastic and args.min_np is None:
        p.error("--elastic needs --min-np (the fewest ranks the job may run on)")
    return args


def choose_runner(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """Explicit --runner wins; --gloo means horovodrun; under Slurm, srun."""
    if args.runner != "auto":
        return str(args.runner)
    if args.gloo or args.elastic:
        return "horovodrun"
    if environ.get("SLURM_JOB_ID") and shutil.which("srun", path=environ.get("PATH")):
        return "srun"
    return "mpiexec"


def program_argv(args: argparse.Namespace) -> list[str]:
    """`x.py` and `-m mod` run on this interpreter (the venv); anything else as given."""
    if args.module:
        prog = [sys.executable, "-m", *args.program]
    elif args.program[0].endswith(".py"):
        prog = [sys.executable, *args.program]
    else:
        prog = list(args.program)
    return prog if args.no_prefix else trampoline(prog)


def _apply_user_env(args: argparse.Namespace, env: dict[str, str]) -> list[str]:
    """Apply -x NAME=VALUE; return the names the user asked to forward."""
    names = []
    for item in args.env:
        name, eq, value = item.partition("=")
        if eq:
            env[name] = value
        names.append(name)
    return names


def read_hosts(path: str) -> list[tuple[str, int | None]]:
    """A hostfile in Open MPI ('h slots=N'), hydra ('h:N') or bare ('h') form."""
    hosts: list[tuple[str, int | None]] = []
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            hosts.append(_host_line(line, f"{path}:{number}"))
    return hosts


def _host_line(line: str, where: str) -> tuple[str, int | None]:
    """One hostfile line; a ValueError naming `where` for a line no runner would read."""
    m = re.fullmatch(r"([^\s:=]+)(?::(\d+))?((?:\s+\w+\s*=\s*\S+)*)", line)
    if m is None:
        raise ValueError(f"hostfile {where}: {line!r} is not 'host', 'host:N' or "
                         "'host slots=N'")
    slots = re.search(r"\bslots\s*=\s*(\S+)", m[3])
    count = slots[1] if slots else m[2]
    if count is not None and not count.isdigit():
        raise ValueError(f"hostfile {where}: {line!r}: slots must be a number")
    return m[1], None if count is None else int(count)


def write_hosts(hosts: list[tuple[str, int | None]], style: str) -> str:
    """Write hosts as `style` reads them (hydra: 'h:N', else 'h slots=N'); the path."""
    fd, path = tempfile.mkstemp(prefix="asynclock-hosts-", text=True)
    with os.fdopen(fd, "w") as f:
        for name, slots in hosts:
            if slots is None:
                f.write(f"{name}\n")
            else:
                f.write(f"{name}:{slots}\n" if style == "hydra" else f"{name} slots={slots}\n")
    return path


def _host_args(args: argparse.Namespace, style: str, plan: Plan) -> list[str]:
    """Host selection in the runner's own flags."""
    inline, from_file = _HOST_FLAGS[style]
    if style == "srun" and (args.hosts or args.hostfile):  # Slurm takes names only
        pairs = read_hosts(args.hostfile) if args.hostfile else [
            (h.partition(":")[0], None) for h in args.hosts.split(",")]
        return [inline, ",".join(name for name, _ in pairs)]
    if args.hosts:
        return [inline, args.hosts]
    if not args.hostfile:
        return []
    path = write_hosts(read_hosts(args.hostfile), style)
    plan.temp_files.append(path)
    return [from_file, path]


def _forward_flags(env: Mapping[str, str], extra: list[str], argv: list[str]) -> list[str]:
    names = sorted({k for k in env if k.startswith(FORWARD_PREFIXES)} | set(extra))
    given = {a.partition("=")[0] for a in argv}
    return [flag for name in names if name in env and name not in given
            for flag in ("-x", name)]


def _mpi_plan(args: argparse.Namespace, kind: str, n: int) -> Plan:
    """The project's MPI via mpi_select; else the `mpiexec` on PATH."""
    kit = kit_environ(kind)
    if kit is not None:
        env, style = kit, mpi_select.describe(kind)["vendor"]
        argv, runner = mpi_select.launcher(kind, n), mpi_select.resolve(kind)
    else:
        env, runner = dict(os.environ), "mpiexec"
        exe = shutil.which("mpiexec", path=env.get("PATH")) or "mpiexec"
        style = "Open MPI" if _is_open_mpi(exe, env) else "MPICH"
        argv = [exe, "-np" if style == "Open MPI" else "-n", str(n)]
    plan = Plan(runner, [], env)
    forward = _apply_user_env(args, env)
    if style == "Open MPI":
        argv += _forward_flags(env, forward, argv) + _host_args(args, "openmpi", plan)
    else:  # hydra forwards the whole environment by default
        argv += _host_args(args, "hydra", plan)
    plan.argv = argv + args.launcher_arg + program_argv(args)
    return plan


def _is_open_mpi(exe: str, env: Mapping[str, str]) -> bool:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30,
                             env=dict(env)).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def _horovodrun_plan(args: argparse.Namespace, n: int) -> Plan:
    """horovodrun: its MPI controller needs Open MPI's mpirun on PATH; --gloo needs none."""
    gloo = args.gloo or args.elastic  # Horovod's elastic driver runs Gloo only
    use_mpi = not gloo and bool(mpi_select.available().get("system"))
    kit = kit_environ("system" if use_mpi else args.mpi or "auto")
    env = kit if kit is not None else dict(os.environ)
    _apply_user_env(args, env)
    exe = Path(sys.executable).with_name("horovodrun")
    runner = str(exe) if exe.exists() else shutil.which("horovodrun", path=env.get("PATH"))
    plan = Plan("horovodrun", [], env, strip_tags=not args.no_prefix)
    argv = [runner or "horovodrun", "-np", str(n), "--mpi" if use_mpi else "--gloo"]
    plan.argv = (argv + _elastic_args(args) + _host_args(args, "horovodrun", plan)
                 + args.launcher_arg + program_argv(args))
    return plan


def _elastic_args(args: argparse.Namespace) -> list[str]:
    """horovodrun's elastic flags (its driver then re-forms the world: `hvd.elastic`)."""
    if not args.elastic:
        return []
    flags = ["--min-np", str(args.min_np)]
    if args.max_np is not None:
        flags += ["--max-np", str(args.max_np)]
    if args.host_discovery_script:
        flags += ["--host-discovery-script", os.path.abspath(args.host_discovery_script)]
    return flags


def _names_srun_plugin(launcher_args: Sequence[str]) -> bool:
    return any(a == "--mpi" or a.startswith("--mpi=") for a in launcher_args)


def _srun_plan(args: argparse.Namespace, n: int | None) -> Plan:
    """srun: Slurm wires up PMI. `--mpi KIND` also picks the libmpi mpi4py loads and,
    unless `--launcher-arg=--mpi=...` names one, the srun plugin that MPI answers to."""
    kit = kit_environ(args.mpi) if args.mpi else None
    env = kit if kit is not None else dict(os.environ)
    _apply_user_env(args, env)
    plan = Plan("srun", [], env)
    argv = ["srun", "--kill-on-bad-exit=1"] + (["-n", str(n)] if n is not None else [])
    if kit is not None and not _names_srun_plugin(args.launcher_arg):
        argv.append(f"--mpi={SRUN_PLUGINS[mpi_select.describe(args.mpi)['vendor']]}")
    plan.argv = argv + _host_args(args, "srun", plan) + args.launcher_arg + program_argv(args)
    return plan


def build_plan(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Plan:
    """Turn parsed arguments into the exact command and environment to run."""
    environ = os.environ if environ is None else environ
    args = argparse.Namespace(**vars(args))  # the -x list below is ours to extend
    if "PYTHONUNBUFFERED" not in environ:  # a killed rank's last lines still show
        args.env = ["PYTHONUNBUFFERED=1", *args.env]
    if args.timeline:  # via -x, so Open MPI forwards it to remote ranks too
        args.env = [*args.env, f"ASYNCLOCK_TIMELINE={os.path.abspath(args.timeline)}"]
    runner = choose_runner(args, environ)
    n = args.nranks if args.nranks is not None else (
        args.min_np if args.elastic else int(environ.get("SLURM_NTASKS", "1")))
    if runner == "srun":
        plan = _srun_plan(args, args.nranks)
    elif runner == "horovodrun":
        plan = _horovodrun_plan(args, n)
    else:
        plan = _mpi_plan(args, runner if runner in ("embedded", "system") else args.mpi or "auto",
                         n)
    return plan


# -- running it ---------------------------------------------------------------------------
def run_plan(plan: Plan, timeout: float | None = None,
             failure_grace_s: float = FAILURE_GRACE_S) -> int:
    """Run the plan: the runner's exit status (128+N for signal N, 124 on timeout)."""
    return run_job(plan.argv, plan.env, strip_tags=plan.strip_tags, timeout=timeout,
                   failure_grace_s=failure_grace_s)


def _merge_timeline(prefix: str) -> None:
    """Merge the ranks' timeline files, also after a failed or killed job."""
    from . import timeline

    try:
        result = timeline.merge(prefix)
    except (OSError, ValueError) as exc:
        print(f"asynclock-launch: timeline not merged: {exc}", file=sys.stderr)
        return
    print(f"asynclock-launch: timeline {result.describe()}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (`asynclock-launch`, `python -m asynclock.launch`)."""
    args = parse_args(argv)
    try:
        plan = build_plan(args)
    except (OSError, ValueError, RuntimeError) as exc:  # a bad hostfile, a missing MPI
        print(f"asynclock-launch: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.dry_run:
            print(shlex.join(plan.argv))
            return 0
        if args.timeline:
            from . import timeline

            timeline.remove_rank_files(args.timeline)
        rc = run_plan(plan, args.timeout, args.failure_grace)
    finally:
        for path in plan.temp_files:
            os.unlink(path)
    if args.timeline:
        _merge_timeline(args.timeline)
    return rc


if __name__ == "__main__":
    sys.exit(main())
