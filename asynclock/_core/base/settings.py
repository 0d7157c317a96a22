"""Every `ASYNCLOCK_*` environment variable, declared once.

Each `Setting` says its name, type, default, meaning, who reads it and whether
every rank of a job must have the same value. The declaration serves three
readers:

* the ranks: `load()` reads every rank-side variable when a coordinator
  starts (never at import), checks each value against its type and choices,
  and keeps that snapshot until `forget()` at shutdown; `number`, `text` and
  `flag` answer from it (from the environment as it is now when no
  coordinator runs, e.g. in a unit test);
* the start-up agreement, which compares `agreed()` across ranks, so a job
  whose ranks were given different values of a setting that changes which
  messages travel fails at once, naming the ranks;
* the docs: `markdown_table()` is the table of docs/reference/environment.md
  (a test fails when the two differ).

The launcher, the MPI kit and the test suite read their variables themselves
(some run before asynclock is importable); they are declared here so that one
table lists them all.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace

__all__ = ["DECLARED", "Setting", "agreed", "flag", "forget", "is_set", "load", "markdown_table",
           "number", "text"]

RANK, LAUNCH, TESTS = "rank", "launch", "tests"  # who reads a variable


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    kind: str  # "number", "text", "flag" (0 or 1) or "path"
    default: str  # as written in the environment; "" means unset
    meaning: str
    agree: bool = False  # every rank of a job must have the same value
    scope: str = RANK
    choices: tuple[str, ...] = ()
    replaces: tuple[str, ...] = ()  # deprecated names read when this one is unset


def _s(name: str, kind: str, default: str, meaning: str, *, agree: bool = False,
       scope: str = RANK, choices: tuple[str, ...] = (),
       replaces: tuple[str, ...] = ()) -> Setting:
    return Setting(f"ASYNCLOCK_{name}", kind, default, meaning, agree, scope, choices,
                   tuple(f"ASYNCLOCK_{old}" for old in replaces))


DECLARED: tuple[Setting, ...] = (
    # -- which transport, and which messages travel: identical on every rank -------------
    _s("BACKEND", "text", "auto", "The transport when `init()`/`start()` get `auto`.",
       agree=True, choices=("auto", "mpi", "horovod", "local")),
    _s("THREAD_MIN_BYTES", "number", "1048576", "Data stages at least this big are waited "
       "for in the lane's wait thread, on the bulk communicator. Unset, on one node under "
       "MPICH, allreduces under 2 MiB (or under WINDOW_MIN_BYTES, where the node window "
       "is on) that a caller awaits stay on the loop, polled (a gradient bucket's still "
       "go to the thread).", agree=True),
    _s("BULK", "text", "auto", "Bulk allreduces across hosts: gloo where MPI's blocking call "
       "spins or gloo measures faster (`auto`), always MPI, always gloo, or measure on one "
       "node too (`measure`).",
       agree=True, choices=("auto", "mpi", "gloo", "measure")),
    _s("GLOO_MIN_BYTES", "number", "16777216", "Smallest allreduce the gloo bulk path may "
       "take.", agree=True),
    _s("GLOO_ROUNDS", "flag", "1", "Where the gloo bulk path takes every gradient bucket "
       "(across hosts where MPI's blocking allreduce spins), the thread that packs a bucket "
       "starts its gloo allreduce, and each round is checked once (0: every bucket through "
       "the event loop and the wait thread).", agree=True),
    _s("NODE_WINDOW", "flag", "1", "Reduce through the node's shared-memory window: large "
       "allreduces where every node holds the same number of ranks, more than one (reduced "
       "there, then across nodes over MPI, one slice per local rank; "
       "ASYNCLOCK_BULK=gloo also turns this off), and gradient buckets when every rank is "
       "on one node, through a /dev/shm file under horovodrun --gloo (0: MPI's own "
       "allreduce for both, Horovod's for buckets without MPI). Replaces `ASYNCLOCK_WINDOW` and "
       "`ASYNCLOCK_SHM`, still read when it is unset (0 in either turns the window off).",
       agree=True, replaces=("WINDOW", "SHM")),
    _s("WINDOW_MIN_BYTES", "number", "1048576", "Smallest allreduce the node window takes "
       "(none below `ASYNCLOCK_THREAD_MIN_BYTES`). It runs in the wait thread, or on the "
       "loop for an allreduce a caller awaits below 8 MiB on one node once the window is "
       "made.", agree=True),
    _s("SYNC_LEASE", "flag", "1", "Locks may stay cached at the rank that used them last "
       "(0: every acquire asks the lock's home rank).", agree=True),
    _s("WATCHDOG", "flag", "1", "Heartbeats between ranks and the stall inspector.",
       agree=True),
    _s("ON_ERROR", "text", "auto", "An uncaught error on one rank stops every rank "
       "(`abort`), or only propagates (`raise`); `reform`: a rank that dies or is cut off "
       "fails the others' collectives with RankFailedError and they go on in a world without "
       "it (elastic jobs). `auto`: `reform` under Horovod's elastic launcher, else `abort`.",
       agree=True, choices=("auto", "abort", "raise", "reform")),
    # -- the progress engine ----------------------------------------------------------------
    _s("SPIN_US", "number", "200", "Microseconds a caller spins on a small collective before "
       "the poller takes it."),
    _s("MAX_SPIN_US", "number", "1000", "Ceiling of the spin the engine adapts per lane."),
    _s("BUSY_US", "number", "2000", "Microseconds the poller keeps testing after progress "
       "before it sleeps."),
    _s("STRAY_S", "number", "10", "Seconds a call awaited by this rank may wait to be matched "
       "by name before the rank reports it cannot proceed (all ranks stuck: every waiting "
       "call fails with UnmatchedError)."),
    _s("FASTPATH", "flag", "1", "The C header round for small collectives (0: the Python "
       "one; the wire protocol is the same)."),
    _s("NODE_ROUND", "flag", "1", "Where every rank of a channel is on one node, its compact "
       "header rounds go through shared memory rather than MPI (C round only; 0: MPI).",
       agree=True),
    _s("NODE_DATA_MAX_BYTES", "number", "262144", "Where a channel's compact rounds go "
       "through shared memory, allreduces up to this size (and over the inline size, below "
       "`ASYNCLOCK_THREAD_MIN_BYTES`) send their data that way too (0: over MPI).",
       agree=True),
    # -- faults and stalls ------------------------------------------------------------------
    _s("HEARTBEAT_S", "number", "0.5", "Seconds between heartbeats."),
    _s("DEAD_AFTER_S", "number", "10", "A peer silent this long is taken for dead."),
    _s("STALL_WARN_S", "number", "60", "A collective waiting this long is reported with the "
       "ranks that have not issued it."),
    _s("STALL_ABORT_S", "number", "0", "A collective waiting this long stops the job "
       "(0: never)."),
    _s("FAILURE_GRACE_S", "number", "2", "Seconds a failing job gives its ranks to print "
       "and leave before they are ended."),
    _s("ELASTIC_NAME_S", "number", "2", "Elastic jobs: seconds a survivor whose collective "
       "failed waits for its watchdog to name the lost rank before it re-forms anyway."),
    _s("FROZEN_DUMP", "flag", "1", "A rank whose watchdog cannot run prints its own stacks "
       "before its peers give up on it."),
    _s("STALL_S", "number", "60", "Gradient rounds: seconds `synchronize()` waits for a "
       "bucket before it names the missing ranks."),
    # -- the TCP mesh (no MPI world: `horovodrun --gloo`) ----------------------------------
    _s("HANDSHAKE_S", "number", "10", "Seconds a connection to asynclock's TCP mesh has to "
       "prove it comes from a rank of the job before it is closed."),
    _s("MESH_HOLD", "path", "", "Test hook: each rank writes its mesh listener's address "
       "into this folder, and every rank but 0 waits for a `go.<mesh>` file there before "
       "it connects."),
    # -- sync primitives --------------------------------------------------------------------
    _s("SYNC_STALL_S", "number", "30", "A sync primitive waiting this long probes the ranks "
       "it depends on."),
    _s("SYNC_PROBE_S", "number", "10", "A probed rank that does not answer within this is "
       "reported failed."),
    _s("SYNC_COLD_SLEEP_US", "number", "100000", "Longest sleep of the sync message pump "
       "while nothing happens."),
    # -- CUDA ---------------------------------------------------------------------------------
    _s("CUDA_PATH", "text", "auto", "How CUDA tensors travel: NCCL through a private "
       "torch.distributed group where every rank has a GPU of its own (`auto`, `nccl`), "
       "host staging into MPI (`staged`), device buffers into a CUDA-aware MPI (`direct`); "
       "`gloo-twin` runs the NCCL path's code on CPU tensors over gloo (tests).",
       agree=True, choices=("auto", "nccl", "staged", "direct", "gloo-twin")),
    _s("CUDA_DIRECT", "text", "auto", "Allreduces on device memory straight to a CUDA-aware "
       "MPI (1), never (0), or where the MPI supports it.", choices=("auto", "0", "1")),
    _s("CUDA_WAIT", "text", "auto", "How `asynclock.cuda.wait` waits for GPU work: poll, a "
       "thread, or poll then a thread.", choices=("auto", "poll", "thread")),
    _s("CUDA_BUSY_US", "number", "1000", "Microseconds `cuda.wait` polls tightly."),
    _s("CUDA_MAX_SLEEP_US", "number", "2000", "Longest sleep between polls of `cuda.wait`."),
    _s("LOCAL_RANK", "number", "", "This rank's index on its node, where the launcher sets "
       "none of its own."),
    # -- recording ----------------------------------------------------------------------------
    _s("TIMELINE", "path", "", "Record a Chrome-trace timeline to this prefix (one file per "
       "rank, merged at the end)."),
    # -- the launcher and the MPI kit ---------------------------------------------------------
    _s("MPI", "text", "auto", "Which MPI the kit and `asynclock-launch` use.", scope=LAUNCH,
       choices=("auto", "embedded", "system")),
    _s("VENV", "path", "", "The virtual environment whose MPI the kit describes.",
       scope=LAUNCH),
    _s("CACHE", "path", "~/.cache/asynclock", "Build cache (Open MPI shims, Horovod, the C "
       "round).", scope=LAUNCH),
    _s("SETUP_SYSTEM_MPI", "flag", "0", "`launch/setup.sh` installs Debian's Open MPI (root; "
       "`launch/test.sh` sets it as root).", scope=LAUNCH),
    _s("SETUP_HOROVOD", "flag", "0", "`launch/setup.sh` builds Horovod 0.28.1 against torch "
       "and the system MPI.", scope=LAUNCH),
    _s("SETUP_UV", "flag", "1", "`launch/setup.sh` installs packages with uv (parallel "
       "downloads; 0: pip alone).", scope=LAUNCH),
    _s("APT_MAX_AGE_H", "number", "24", "Hours before the Open MPI installer refreshes the "
       "package lists.", scope=LAUNCH),
    _s("TIMEOUT_S", "number", "3300", "Time limit of the Slurm recipe's job "
       "(launch/slurm.sbatch).", scope=LAUNCH),
    _s("MIN_NP", "number", "", "The elastic Slurm recipe's --min-np (launch/slurm_elastic."
       "sbatch; unset: half the allocation's tasks).", scope=LAUNCH),
    _s("MAX_REQUEUES", "number", "3", "How often the elastic Slurm recipe requeues a job "
       "that ended below --min-np.", scope=LAUNCH),
    # -- the test suite and the benchmarks ----------------------------------------------------
    _s("TEST_MPI", "text", "auto", "The MPI the test suite starts its jobs with.", scope=TESTS,
       choices=("auto", "embedded", "system")),
    _s("TEST_WORKERS", "number", "2", "pytest workers for launch/test.sh's parallel phase "
       "(0: every test in one process).", scope=TESTS),
    _s("TEST_CPU_LOG", "path", "", "File that pytest appends each test's CPU seconds "
       "(its jobs' ranks included) and wall seconds to.", scope=TESTS),
    _s("TEST_BACKENDS", "text", "mpi,horovod", "Backends the torch tests run on.",
       scope=TESTS),
    _s("CONFORMANCE_TARGET", "text", "asynclock", "What Horovod's own tests run against.",
       scope=TESTS, choices=("asynclock", "horovod")),
    _s("CONFORMANCE_SELECT", "text", "", "A pytest -k expression for Horovod's tests.",
       scope=TESTS),
    _s("CONFORMANCE_FROM", "text", "", "Run Horovod's tests from this one on.", scope=TESTS),
    _s("CONFORMANCE_LOG", "path", "", "Per-rank outcome log of Horovod's tests (set by the "
       "runner).", scope=TESTS),
    _s("CONFORMANCE_TIMEOUT_METHOD", "text", "signal", "pytest-timeout's method per test.",
       scope=TESTS, choices=("signal", "thread")),
    _s("CONFORMANCE_SHORT", "text", "", "Horovod's tests that get a per-test timeout of their "
       "own: their names, then the seconds.", scope=TESTS),
    _s("NETRIG", "path", "", "The netrig tool (default: ../shared/netrig).", scope=TESTS),
    _s("NETRIG_TESTS", "flag", "1", "Run the tests across network-namespace hosts.",
       scope=TESTS),
    _s("NETRIG_LOCK", "path", "/tmp/asynclock-netrig.lock", "Lock file that keeps two rigs "
       "apart.", scope=TESTS),
    _s("GPU_PYTHON", "path", "", "The Python with CUDA torch for tests/gpu/run.sh.",
       scope=TESTS),
    _s("REQUIRE_GPU", "flag", "0", "GPU tests fail instead of skipping without CUDA.",
       scope=TESTS),
    _s("REQUIRE_FASTPATH", "flag", "0", "Tests of the C small-message round fail instead "
       "of skipping where it does not load (`launch/test.sh` sets it where it can be "
       "built).", scope=TESTS),
    _s("WHEELS", "path", "wheels/", "Wheel folder of tests/gpu/run.sh.", scope=TESTS),
    _s("GPU_BUDGET_S", "number", "450", "Seconds tests/gpu/run.sh may spend on the GPU "
       "machine.", scope=TESTS),
    _s("GPU_LOGS", "path", ".gpu-logs/", "Where tests/gpu/run.sh writes its logs.",
       scope=TESTS),
    _s("BENCH_HOROVOD", "flag", "1", "bench/collectives.py loads Horovod as a peer.",
       scope=TESTS),
)

_BY_NAME = {s.name: s for s in DECLARED}
_OLD_NAMES = {old: s for s in DECLARED for old in s.replaces}
_snapshot: dict[str, str] | None = None
_given: frozenset[str] = frozenset()  # names the snapshot's environment set


def _setting(name: str) -> Setting:
    try:
        return _BY_NAME[name]
    except KeyError:
        if name in _OLD_NAMES:
            raise KeyError(f"{name} is an old name of {_OLD_NAMES[name].name}; read that "
                           "one") from None
        raise KeyError(f"{name} is not a declared asynclock setting") from None


def _checked(setting: Setting, raw: str) -> str:
    """The value to use (the default when unset or empty), or a ValueError naming it."""
    value = raw.strip() or setting.default
    if setting.kind == "number" and value:
        try:
            float(value)
        except ValueError:
            raise ValueError(f"{setting.name}={raw!r} is not a number") from None
    if setting.kind == "flag" and value not in ("0", "1"):
        raise ValueError(f"{setting.name}={raw!r}: use 0 or 1")
    if setting.choices and value not in setting.choices:
        raise ValueError(f"{setting.name}={raw!r}: use one of {', '.join(setting.choices)}")
    return value


def _raw(setting: Setting, env: Mapping[str, str]) -> str:
    """The setting's value in `env`; unset, what its deprecated names say (a flag is
    off when any of them is 0)."""
    raw = env.get(setting.name, "")
    if raw.strip() or not setting.replaces:
        return raw
    old = [_checked(replace(setting, name=name), env[name]) for name in setting.replaces
           if env.get(name, "").strip()]
    return ("0" if "0" in old else old[0]) if old else raw


def load(environ: Mapping[str, str] | None = None) -> None:
    """Read and check every rank-side setting now (a coordinator starts)."""
    global _snapshot, _given
    env = os.environ if environ is None else environ
    _snapshot = {s.name: _checked(s, _raw(s, env)) for s in DECLARED if s.scope == RANK}
    _given = frozenset(name for name in _snapshot if _raw(_BY_NAME[name], env).strip())
    for old in sorted(set(_OLD_NAMES) & {k for k, v in env.items() if v.strip()}):
        warnings.warn(f"{old} is deprecated: set {_OLD_NAMES[old].name} instead",
                      FutureWarning, stacklevel=2)


def forget() -> None:
    """The coordinator is gone: read the environment afresh from now on."""
    global _snapshot
    _snapshot = None


def _value(name: str) -> str:
    setting = _setting(name)
    if _snapshot is not None and name in _snapshot:
        return _snapshot[name]
    return _checked(setting, _raw(setting, os.environ))


def is_set(name: str) -> bool:
    """The environment gives `name` a value (rather than leaving the default)."""
    setting = _setting(name)
    if _snapshot is not None and name in _snapshot:
        return name in _given
    return bool(_raw(setting, os.environ).strip())


def number(name: str) -> float:
    """A numeric setting (NaN for an unset one without default)."""
    value = _value(name)
    return float(value) if value else float("nan")


def text(name: str) -> str:
    return _value(name)


def flag(name: str) -> bool:
    return _value(name) == "1"


def agreed() -> dict[str, str]:
    """The settings every rank must share, as this rank has them."""
    return {s.name: _value(s.name) for s in DECLARED if s.agree}


_SCOPES = {RANK: "Read by every rank when asynclock starts",
           LAUNCH: "Read by the launcher and the MPI kit",
           TESTS: "Read by the test suite and the benchmarks"}


def markdown_table() -> str:
    """The environment-variable tables of the docs, one per reader."""
    out: list[str] = []
    for scope, title in _SCOPES.items():
        out += [f"### {title}", "", "| variable | type | default | same on every rank | "
                "meaning |", "| --- | --- | --- | --- | --- |"]
        for s in DECLARED:
            if s.scope != scope:
                continue
            kind = s.kind + (f" ({', '.join(s.choices)})" if s.choices else "")
            default = f"`{s.default}`" if s.default else "unset"
            out.append(f"| `{s.name}` | {kind} | {default} | {'yes' if s.agree else ''} | "
                       f"{s.meaning} |")
        out.append("")
    return "\n".join(out)
