#!/usr/bin/env bash
# horovodrun recipe: run a Horovod (or asynclock-on-Horovod) program on N ranks.
#
#   bash launch/horovodrun.sh gloo 2 examples/train_digits.py [args...]
#   bash launch/horovodrun.sh mpi  4 train.py            # MPI controller (Open MPI)
#   HOSTS=node01:4,node02:4 bash launch/horovodrun.sh gloo 8 train.py
#
# Why two modes: horovodrun's MPI controller runs `mpirun` and needs Open MPI
# (Debian's, via mpi/mpi_select.py env system: mpirun and libmpi.so.40 together);
# the Gloo controller needs no MPI launcher at all and works with either MPI
# (mpi4py inside the ranks then sees one singleton rank; asynclock picks its
# Horovod backend there, and its MPI backend under the MPI controller, where
# mpirun started the ranks). asynclock-launch does the same and also
# tags lines "[rank] ", adds --timeout and --timeline:
#   asynclock-launch -n 2 --runner horovodrun [--gloo] train.py
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: horovodrun.sh gloo|mpi N program.py [args...]}
n=${2:?number of ranks}
shift 2
PY="$PWD/.venv/bin/python"
hosts=()
if [ -n "${HOSTS:-}" ]; then hosts=(-H "$HOSTS"); fi
case "$mode" in
  mpi)
    eval "$("$PY" mpi/mpi_select.py env system)"
    exec "$PWD/.venv/bin/horovodrun" --mpi -np "$n" "${hosts[@]}" "$PY" "$@" ;;
  gloo)
    exec "$PWD/.venv/bin/horovodrun" --gloo -np "$n" "${hosts[@]}" "$PY" "$@" ;;
  *)
    echo "horovodrun.sh: mode must be gloo or mpi, not '$mode'" >&2; exit 2 ;;
esac
