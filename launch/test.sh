#!/usr/bin/env bash
# README command 2: set up everything the suite needs and run all tests.
# As root it also installs Debian's Open MPI (horovodrun's MPI controller needs it), Slurm
# and munge (tests/test_slurm.py starts a private cluster), and
# builds Horovod 0.28.1 against torch and that MPI (cached: ~3 min the first time).
# Extra arguments go to pytest (e.g. -k sync, --long).
set -uo pipefail
cd "$(dirname "$0")/.."
begun=$(date +%s)
elapsed() { echo "[test] $1 after $(( $(date +%s) - begun )) s" >&2; }
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export ASYNCLOCK_SETUP_SYSTEM_MPI=${ASYNCLOCK_SETUP_SYSTEM_MPI:-1}
  export ASYNCLOCK_SETUP_HOROVOD=${ASYNCLOCK_SETUP_HOROVOD:-1}
fi
bash launch/setup.sh || { echo "[test] setup failed" >&2; exit 1; }
elapsed "setup done"
# Every rank of every test job imports the project's modules. Where PYTHONDONTWRITEBYTECODE
# is set nothing caches their bytecode, and each process would compile
# them again: compile them once here (stale files are ignored, so edits stay safe).
.venv/bin/python -m compileall -q asynclock tests mpi bench launch >/dev/null \
  || echo "[test] byte-compiling the sources failed; tests compile them as they go" >&2
# Setup builds the C small-message round for every MPI with a compiler wrapper. Where the
# MPI the tests run on has one (and Python's headers), its tests fail instead of skipping
# when the round does not load: a build that broke must not pass as a skip.
if .venv/bin/python mpi/build_fastpath.py --can-build "${ASYNCLOCK_TEST_MPI:-auto}"; then
  export ASYNCLOCK_REQUIRE_FASTPATH=${ASYNCLOCK_REQUIRE_FASTPATH:-1}
fi
# The MPI doctor's report and the static checks (lint, strict types, the declared layers)
# run side by side; their reports print in that order.
# mypy keeps its cache beside setup's (the Horovod wheel, the MPI kit): a fresh clone of
# unchanged sources then takes seconds instead of a full strict check.
export MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-${HOME:-/tmp}/.cache/asynclock/mypy}
report=$(mktemp -d)
(.venv/bin/python mpi/doctor.py >"$report/doctor" 2>&1 || true) &
doctor=$!
static=0
{
  .venv/bin/python -m ruff check asynclock tests || static=1
  .venv/bin/python -m mypy --strict asynclock || static=1
  .venv/bin/lint-imports --no-cache || static=1
} >"$report/static" 2>&1
wait "$doctor"
cat "$report/doctor" "$report/static"
rm -rf "$report"
elapsed "static checks done"
[ "$static" = 0 ] || echo "[test] static checks failed (ruff, mypy --strict, import-linter)" >&2
# Most test time is rank start-up and waiting on other ranks, so two pytest workers share
# the machine's cores (whole files to a worker: a file's tests share its cached jobs).
# Then the launcher's timed jobs (`serial`: mostly waiting out timeouts and signals), two at
# a time, and last the tests that time microsecond calls (`alone`), alone on the machine.
# ASYNCLOCK_TEST_WORKERS=0 runs all in one.
workers=${ASYNCLOCK_TEST_WORKERS:-2}
pytest=(.venv/bin/python -m pytest -ra --durations=30 -p no:cacheprovider)
rcs=()
if [ "$workers" -gt 0 ] && .venv/bin/python -c "import xdist" 2>/dev/null; then
  "${pytest[@]}" -n "$workers" --dist loadfile -m "not serial and not alone" "$@" tests
  rcs+=($?)
  elapsed "parallel phase done"
  "${pytest[@]}" -n 2 -m "serial and not alone" "$@" tests
  rcs+=($?)
  elapsed "serial phase done"
  "${pytest[@]}" -m alone "$@" tests
  rcs+=($?)
  elapsed "alone phase done"
else
  "${pytest[@]}" "$@" tests
  rcs+=($?)
fi
# A phase that collects nothing (5) is fine when another ran tests.
rc=5
for r in "${rcs[@]}"; do
  if [ "$r" != 0 ] && [ "$r" != 5 ]; then rc=$r; break; fi
  [ "$r" = 0 ] && rc=0
done
if [ "$rc" = 0 ] && [ "$static" != 0 ]; then rc=1; fi
if [ "$rc" = 5 ]; then echo "[test] pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
