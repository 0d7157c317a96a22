"""Run Horovod's own PyTorch tests against asynclock or real Horovod; merge the ranks.

    python tests/conformance/run.py --target asynclock --np 2 [--mpi system] [--out DIR]
    python tests/conformance/run.py --target horovod --np 2 --write-reference

A test's outcome is merged over ranks: `passed` only where every rank passed it,
`skipped` where every rank skipped it, `failed` where any rank failed or errored,
and `missing` where a rank never reported it (the job hung or crashed first).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SUITE = ROOT.parent / "shared" / "conformance" / "horovod" / "test" / "parallel"
FILES = ("test_torch.py", "test_adasum_pytorch.py")
REFERENCE = HERE / "reference.json"
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the checkout's package
from asynclock._tools import mpi_select  # noqa: E402


def suite_missing() -> str:
    """Why the suite cannot run here ("" when it can)."""
    if not SUITE.is_dir():
        return f"Horovod's test files are not at {SUITE} (they come with the project's shared/)"
    return ""


def run(target: str, nranks: int, out: Path, *, kind: str = "auto", timeout: float = 360,
        test_timeout: int = 60, files: tuple[str, ...] = FILES,
        env: dict[str, str] | None = None) -> dict[str, object]:
    """One job: every rank runs pytest over `files`; returns the merged summary."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*"):
        old.unlink()
    full_env = mpi_select.environ_for(kind)
    full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                     "PYTHONDONTWRITEBYTECODE": "1",
                     "ASYNCLOCK_CONFORMANCE_TARGET": target,
                     "PYTHONPATH": str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")})
    full_env.update(env or {})
    cmd = [*mpi_select.launcher(kind, nranks), sys.executable, str(HERE / "rank_pytest.py"),
           str(out), str(test_timeout), *(str(SUITE / f) for f in files)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=SUITE, start_new_session=True)
    timed_out = False
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        timed_out = True
    (out / "output.txt").write_text(text)
    merged = merge([read_log(out / f"rank{r}.jsonl") for r in range(nranks)])
    counts: dict[str, int] = {}
    for outcome in merged.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    summary = {"target": target, "np": nranks, "mpi": mpi_select.resolve(kind),
               "seconds": round(time.monotonic() - start, 1), "returncode": proc.returncode,
               "timed_out": timed_out, "counts": counts, "tests": merged}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    return summary


def read_log(path: Path) -> dict[str, str]:
    """test -> outcome on one rank (a failed setup/teardown fails the test)."""
    outcomes: dict[str, str] = {}
    if not path.exists():
        return outcomes
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["outcome"] == "failed" or outcomes.get(row["test"]) != "failed":
            outcomes[row["test"]] = row["outcome"]
    return outcomes


def per_rank(out: Path, nranks: int, test: str) -> list[str]:
    """What each rank reported for `test`: its outcome and the last line of its failure
    (which rank failed an assertion and which waited for it until the timeout)."""
    said = []
    for r in range(nranks):
        path, seen = out / f"rank{r}.jsonl", "missing"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            if row["test"] == test and (row["outcome"] == "failed" or seen == "missing"):
                lines = row.get("detail", "").strip().splitlines()
                errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
                seen = f"{row['outcome']} {(errors or lines or [''])[-1][:160]}".strip()
        said.append(f"rank {r}: {seen}")
    return said


def merge(ranks: list[dict[str, str]]) -> dict[str, str]:
    names = sorted(set().union(*ranks)) if ranks else []
    merged: dict[str, str] = {}
    for name in names:
        seen = [r.get(name, "missing") for r in ranks]
        if "missing" in seen:
            merged[name] = "missing"
        elif "failed" in seen:
            merged[name] = "failed"
        elif all(s == "skipped" for s in seen):
            merged[name] = "skipped"
        elif all(s in ("passed", "skipped") for s in seen) and "passed" in seen:
            merged[name] = "passed" if all(s == "passed" for s in seen) else "partly skipped"
        else:
            merged[name] = "/".join(seen)
    return merged


def reference_run(nranks: int, out: Path, file: str, kind: str, timeout: float,
                  env: dict[str, str]) -> dict[str, object]:
    """Real Horovod over `file`, in as many jobs as it takes: where a job hangs,
    the test it hung in is recorded as `hung` and a fresh job starts at the
    test after it (at 3 ranks real Horovod hangs in the test that follows some
    of its process-set tests, and passes that test in a fresh job)."""
    tests: dict[str, str] = {}
    start, jobs, seconds = env.get("ASYNCLOCK_CONFORMANCE_FROM", ""), 0, 0.0
    order = test_order(file)
    while True:
        # a hang inside Horovod's C++ wait ignores signals: the thread method ends
        # the rank (and so the job) at a short per-test timeout instead
        job_env = {**env, "ASYNCLOCK_CONFORMANCE_TIMEOUT_METHOD": "thread",
                   **({"ASYNCLOCK_CONFORMANCE_FROM": start} if start else {})}
        summary = run("horovod", nranks, out / f"job{jobs}", kind=kind, timeout=timeout,
                      test_timeout=30, files=(file,), env=job_env)
        jobs += 1
        seconds += float(summary["seconds"])  # type: ignore[arg-type]
        got: dict[str, str] = summary["tests"]  # type: ignore[assignment]
        tests.update({t: o for t, o in got.items() if o != "missing"})
        left = [t for t in order[order.index(start) if start else 0:] if t not in tests]
        if not left:
            break  # every test ran
        if len(left) < 2:
            tests.update({t: "hung" for t in left})
            break
        tests[left[0]] = "hung"
        start = left[1]
    counts: dict[str, int] = {}
    for outcome in tests.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"target": "horovod", "np": nranks, "jobs": jobs, "seconds": round(seconds, 1),
            "timed_out": False, "counts": counts, "tests": tests}


def test_order(file: str) -> list[str]:
    """The order pytest runs a unittest file's tests in: by name."""
    import re

    return sorted(set(re.findall(r"^\s+def (test_\w+)\(", (SUITE / file).read_text(), re.M)))


def load_reference() -> dict[str, dict[str, dict[str, str]]]:
    """{np: {file: {test: outcome}}} as real Horovod 0.28.1 gave them here."""
    if not REFERENCE.exists():
        return {}
    data: dict[str, dict[str, dict[str, str]]] = json.loads(REFERENCE.read_text())["outcomes"]
    return data


def record_reference(nranks: int, file: str, tests: dict[str, str], seconds: str,
                     merge: bool = False) -> None:
    doc = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {
        "about": "Outcomes of Horovod's own test files on real Horovod 0.28.1 (built by "
                 "launch/test.sh against torch and Open MPI), one pytest per rank under "
                 "mpirun, merged over ranks; written by run.py --write-reference.",
        "outcomes": {}, "seconds": {}}
    per_file = doc["outcomes"].setdefault(str(nranks), {})
    per_file[file] = {**per_file.get(file, {}), **tests} if merge else tests
    doc["seconds"].setdefault(str(nranks), {})[file] = seconds
    REFERENCE.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("asynclock", "horovod"), default="asynclock")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--mpi", default="auto")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=360)
    ap.add_argument("-k", dest="select", default="", help="run only tests whose name has this")
    ap.add_argument("--file", action="append", choices=FILES, help="default: each in turn")
    ap.add_argument("--from", dest="start", default="",
                    help="start at this test (a second job after a test that hangs)")
    ap.add_argument("--write-reference", action="store_true",
                    help="record the outcomes in reference.json (use with --target horovod)")
    args = ap.parse_args()
    why = suite_missing()
    if why:
        print(why)
        return 2
    out = args.out or Path("/tmp") / f"conformance-{args.target}-{args.np}"
    env = {"ASYNCLOCK_CONFORMANCE_SELECT": args.select} if args.select else {}
    if args.start:
        env["ASYNCLOCK_CONFORMANCE_FROM"] = args.start
    for file in args.file or FILES:  # one job per file, as Horovod's CI runs them
        if args.write_reference:
            summary = reference_run(args.np, out / Path(file).stem, file, args.mpi,
                                    args.timeout, env)
        else:
            summary = run(args.target, args.np, out / Path(file).stem, kind=args.mpi,
                          timeout=args.timeout, files=(file,), env=env)
        tests = summary.pop("tests")
        print(file, json.dumps(summary))
        assert isinstance(tests, dict)
        if args.write_reference:
            record_reference(args.np, file, tests, str(summary["seconds"]), merge=bool(args.start))
        for name, outcome in sorted(tests.items()):
            if outcome != "passed":
                print(f"  {outcome:8} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
