#!/usr/bin/env bash
# Run a python program on N ranks with the project's MPI (embedded or system):
#   bash launch/run.sh 2 examples/train_digits.py [args...]
#   ASYNCLOCK_MPI=embedded|system|auto picks the MPI (default auto: system when installed).
set -euo pipefail
cd "$(dirname "$0")/.."
n=$1; shift
kind=${ASYNCLOCK_MPI:-auto}
eval "$(.venv/bin/python mpi/mpi_select.py env "$kind")"
read -r -a prefix <<< "$(.venv/bin/python mpi/mpi_select.py launcher "$kind" -n "$n")"
exec "${prefix[@]}" "$PWD/.venv/bin/python" "$@"
