#!/usr/bin/env bash
# Demonstrate Horovod on this box under each launcher, with timings.
#
# Why: one script that shows the env each launcher needs and proves that
# horovodrun (MPI and Gloo controllers), plain mpirun, and mpi4py-owned MPI
# all work against the Horovod built by mpi/build_horovod.py.
#
# Usage: bash mpi/demo_horovod.sh [system|embedded|auto] [NRANKS=2] [ITERS=1000]
set -uo pipefail

KIND="${1:-system}"
NP="${2:-2}"
ITERS="${3:-1000}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SMOKE="$HERE/hvd_smoke.py"
eval "$(python3 "$HERE/mpi_select.py" env "$KIND")" || exit 1
PY="$(command -v python)"
FAILS=0

step() {
    # step TITLE CMD...: print the command, run it, print its wall time.
    local title="$1"; shift
    echo; echo "=== $title"; echo "\$ $*"
    local t0=$(date +%s.%N)
    "$@" 2>&1 | grep -v -E '^\s*$' | tail -n 20
    local rc=${PIPESTATUS[0]}
    local t1=$(date +%s.%N)
    awk -v a="$t0" -v b="$t1" -v rc="$rc" 'BEGIN { printf "--- rc=%d wall=%.2fs\n", rc, b - a }'
    (( rc == 0 )) || FAILS=$((FAILS + 1))
}

echo "MPI kind: $ASYNCLOCK_MPI  MPI4PY_LIBMPI=$MPI4PY_LIBMPI"
echo "mpirun: $(command -v mpirun)  python: $PY"
env | grep -E '^(OMPI_|MPI4PY_|ASYNCLOCK_)' | sort

if [[ "$ASYNCLOCK_MPI" == "system" ]]; then
    step "(a) horovodrun MPI controller, -np $NP" \
        horovodrun --mpi -np "$NP" "$PY" "$SMOKE" allreduce
    step "(a') horovodrun MPI controller, -np 3 (oversubscribed on $(nproc) cores)" \
        horovodrun --mpi -np 3 "$PY" "$SMOKE" allreduce
fi
step "(b) horovodrun --gloo, -np $NP" horovodrun --gloo -np "$NP" "$PY" "$SMOKE" allreduce
step "(c) plain launcher, -np $NP" $(python3 "$HERE/mpi_select.py" launcher "$KIND" -n "$NP") \
    "$PY" "$SMOKE" allreduce
step "(c') plain launcher, -np 3" $(python3 "$HERE/mpi_select.py" launcher "$KIND" -n 3) \
    "$PY" "$SMOKE" allreduce
step "(d) mpi4py owns MPI_Init, hvd.init(comm=MPI.COMM_WORLD)" \
    $(python3 "$HERE/mpi_select.py" launcher "$KIND" -n "$NP") "$PY" "$SMOKE" mpi4py
step "(d') hvd.init(comm=MPI.COMM_WORLD.Dup())" \
    $(python3 "$HERE/mpi_select.py" launcher "$KIND" -n "$NP") "$PY" "$SMOKE" mpi4py-dup

echo; echo "=== start-up: launcher + import + hvd.init + shutdown (no work)"
INIT='import horovod.torch as hvd; hvd.init(); hvd.shutdown()'
if [[ "$ASYNCLOCK_MPI" == "system" ]]; then
    step "start-up horovodrun --mpi" horovodrun --mpi -np "$NP" "$PY" -c "$INIT"
fi
step "start-up horovodrun --gloo" horovodrun --gloo -np "$NP" "$PY" -c "$INIT"
step "start-up plain launcher" $(python3 "$HERE/mpi_select.py" launcher "$KIND" -n "$NP") "$PY" -c "$INIT"

if [[ "$ASYNCLOCK_MPI" == "system" ]]; then
    step "latency horovodrun --mpi" horovodrun --mpi -np "$NP" "$PY" "$SMOKE" latency "$ITERS"
fi
step "latency horovodrun --gloo" horovodrun --gloo -np "$NP" "$PY" "$SMOKE" latency "$ITERS"
step "latency plain launcher" $(python3 "$HERE/mpi_select.py" launcher "$KIND" -n "$NP") \
    "$PY" "$SMOKE" latency "$ITERS"

echo; echo "demo_horovod: $FAILS step(s) failed"
exit $(( FAILS > 0 ))
