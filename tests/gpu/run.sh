#!/usr/bin/env bash
# GPU check for asynclock.cuda and asynclock.staging: one script, no internet.
#
#   bash tests/gpu/run.sh            # from anywhere; finishes in < 8 min on one H200
#   bash tests/gpu/run.sh --dry-run  # no GPU: the project's .venv, CPU tensors, gloo for NCCL
#                                    # (what can run without a GPU; CI runs it)
#
# What it runs, each step under its own `timeout` and a global 7.5-minute budget:
#   1. nvidia-smi
#   2. a Python environment with CUDA torch (see below)
#   3. tests/test_cuda.py          CPU paths (no-ops, polling against the event protocol, gate order)
#   4. tests/gpu/ -m gpu           GPU tests in-process + MPI jobs at 1 rank and 2 ranks sharing the GPU
#   4b. tests/gpu/nccl_path.py     the NCCL path at 1 rank; 2 ranks sharing the GPU agree on staging
#   5. tests/gpu/bench_wait_gpu.py poll vs thread vs blocking waits (latency, CPU, loop liveness)
#   6. tests/gpu/bench_train_gpu.py on 1 rank and on 2 ranks sharing the GPU
#   7. tests/gpu/bench_step_gpu.py at 1 rank: ResNet-18-sized CNN and a small transformer in
#      bf16, compute / DDP (NCCL) / the drop-in / the async API (target <= 1.02x DDP)
# then prints a summary (PASS/FAIL per step and the benchmark medians) and exits non-zero
# if any step failed.
#
# Python environment, first that works:
#   a. $ASYNCLOCK_GPU_PYTHON, if set;
#   b. .venv-gpu/bin/python, if it imports torch with CUDA and the test deps;
#   c. .venv-gpu created with --system-site-packages on top of a python3 whose torch sees CUDA
#      (typical GPU images): only the missing pure deps are installed, from the wheel folder;
#   d. .venv-gpu created from scratch with everything from the wheel folder.
# The wheel folder is $ASYNCLOCK_WHEELS (default: wheels/ at the repository root). A maintainer
# fills it on a machine with internet, same Python version and platform as the GPU machine:
#     pip download -d wheels torch==2.13.0 numpy anyio sniffio trio mpi4py mpich \
#                            pytest pytest-timeout
# (torch==2.13.0 from PyPI is the CUDA build and pulls the nvidia-* wheels, a few GB; keep the
# folder out of git). Installs always use `pip --no-index --find-links`, so nothing is fetched
# from the network; when something is missing the script says which package and stops.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
START=$(date +%s)
BUDGET=${ASYNCLOCK_GPU_BUDGET_S:-450}
WHEELS=${ASYNCLOCK_WHEELS:-$ROOT/wheels}
LOGDIR=${ASYNCLOCK_GPU_LOGS:-$ROOT/.gpu-logs}
mkdir -p "$LOGDIR"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export ASYNCLOCK_TEST_MPI=${ASYNCLOCK_TEST_MPI:-auto}
RESULTS=()
FAILED=0

log() { printf '[gpu-check %3ds] %s\n' "$(( $(date +%s) - START ))" "$*" >&2; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME LIMIT_S CMD...: run under timeout (capped by the budget left), log to $LOGDIR/NAME.log
step() {
  local name=$1 limit=$2; shift 2
  local rest; rest=$(left)
  if (( rest < 20 )); then RESULTS+=("SKIP  $name (time budget spent)"); FAILED=1; return; fi
  (( limit > rest )) && limit=$rest
  log "=== $name (limit ${limit}s)"
  local t0=$(date +%s) rc=0
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGDIR/$name.log" || rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  if (( rc == 0 )); then RESULTS+=("PASS  $name (${dt}s)")
  elif (( rc == 124 || rc == 137 )); then RESULTS+=("FAIL  $name: timed out after ${limit}s"); FAILED=1
  else RESULTS+=("FAIL  $name: exit $rc (${dt}s, log $LOGDIR/$name.log)"); FAILED=1; fi
}

summary() {
  echo
  echo "================ asynclock GPU check: summary ($(( $(date +%s) - START ))s) ================"
  printf '%s\n' "${RESULTS[@]}"
  if compgen -G "$LOGDIR/*.log" >/dev/null; then
    echo "--- benchmark medians ---"
    grep -h '^SUMMARY' "$LOGDIR"/*.log 2>/dev/null | sed 's/^SUMMARY /  /' || true
    echo "--- pytest ---"
    grep -hE '^(=+ )?[0-9]+ (passed|failed|skipped|errors?)|^FAILED|^ERROR' "$LOGDIR"/*.log 2>/dev/null || true
  fi
  echo "overall: $([ "$FAILED" = 0 ] && echo PASS || echo FAIL)"
}
trap summary EXIT

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
launcher() {  # launcher N: the MPI launcher's words for N ranks
  "$PY" mpi/mpi_select.py launcher "$ASYNCLOCK_TEST_MPI" -n "$1"
}

if [ "$DRY" = 1 ]; then
  # The script's own steps, where no GPU is: CPU tensors, and gloo where NCCL would be.
  PY=$ROOT/.venv/bin/python
  RESULTS+=("PASS  dry run: $PY, CPU tensors, ASYNCLOCK_CUDA_PATH=gloo-twin")
  eval "$("$PY" mpi/mpi_select.py env "$ASYNCLOCK_TEST_MPI")"
  # CI runs tests/test_cuda.py itself: here only its collection, so the step's words stay right
  step test_cuda_cpu_paths 120 "$PY" -m pytest -q -p no:cacheprovider --co tests/test_cuda.py
  read -r -a L1 <<< "$(launcher 1)"
  read -r -a L2 <<< "$(launcher 2)"
  ASYNCLOCK_NODE_WINDOW=0 ASYNCLOCK_CUDA_PATH=gloo-twin step nccl_path_1rank 120 "${L1[@]}" "$PY" tests/gpu/nccl_path.py --cpu
  ASYNCLOCK_NODE_WINDOW=0 ASYNCLOCK_CUDA_PATH=gloo-twin step nccl_path_2ranks 120 "${L2[@]}" "$PY" tests/gpu/nccl_path.py --cpu
  for api in dropin async; do
    ASYNCLOCK_NODE_WINDOW=0 ASYNCLOCK_CUDA_PATH=gloo-twin step "bench_step_$api" 120 "${L1[@]}" "$PY" \
      tests/gpu/bench_step_gpu.py --cpu --api "$api" --steps 2 --windows 2 --warmup 1
  done
  [ "$FAILED" = 0 ]
  exit
fi

# -- 1. the GPU --------------------------------------------------------------------------
log "nvidia-smi"
if ! timeout 30 nvidia-smi; then
  RESULTS+=("FAIL  nvidia-smi: no NVIDIA GPU or driver visible"); FAILED=1; exit 2
fi
RESULTS+=("PASS  nvidia-smi")

# -- 2. Python with CUDA torch -------------------------------------------------------------
DEPS=(numpy anyio sniffio trio mpi4py pytest pytest_timeout)
has_cuda_torch() { timeout 120 "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
missing_deps() {  # prints pip names of what $1 cannot import (mpich: the embedded MPI wheel)
  local py=$1 m
  for m in "${DEPS[@]}"; do timeout 60 "$py" -c "import $m" 2>/dev/null || echo "${m//_/-}"; done
  if ! compgen -G "$(dirname "$py")/../lib/libmpi.so*" >/dev/null && ! command -v mpirun >/dev/null; then
    echo mpich
  fi
}
install_from_wheels() {  # install_from_wheels PY PKG...
  local py=$1; shift
  [ $# -eq 0 ] && return 0
  if [ ! -d "$WHEELS" ]; then
    log "missing packages: $* — and no wheel folder at $WHEELS"
    log "fill it on a machine with internet:  pip download -d wheels $*"
    return 1
  fi
  log "installing from $WHEELS (no network): $*"
  timeout 600 "$py" -m pip install -q --no-index --find-links "$WHEELS" "$@" || {
    log "pip could not install: $* from $WHEELS; missing wheels? (pip download -d wheels $*)"
    return 1; }
}
pick_python() {
  if [ -n "${ASYNCLOCK_GPU_PYTHON:-}" ]; then echo "$ASYNCLOCK_GPU_PYTHON"; return; fi
  local venv=$ROOT/.venv-gpu
  if [ -x "$venv/bin/python" ] && has_cuda_torch "$venv/bin/python"; then
    install_from_wheels "$venv/bin/python" $(missing_deps "$venv/bin/python") >&2 || return 1
    echo "$venv/bin/python"; return
  fi
  local base=${PYTHON:-python3}
  rm -rf "$venv"
  if has_cuda_torch "$base"; then
    log "using $base's CUDA torch through a --system-site-packages venv" >&2
    timeout 120 "$base" -m venv --system-site-packages "$venv" >&2
  else
    log "no python with CUDA torch found; building .venv-gpu from $WHEELS" >&2
    timeout 120 "$base" -m venv "$venv" >&2
    install_from_wheels "$venv/bin/python" torch==2.13.0 >&2 || return 1
  fi
  install_from_wheels "$venv/bin/python" $(missing_deps "$venv/bin/python") >&2 || return 1
  has_cuda_torch "$venv/bin/python" || { log "torch in .venv-gpu does not see CUDA" >&2; return 1; }
  echo "$venv/bin/python"
}
if ! PY=$(pick_python); then
  RESULTS+=("FAIL  python environment (see messages above: missing wheels?)"); FAILED=1; exit 3
fi
RESULTS+=("PASS  python environment: $PY")
timeout 120 "$PY" - <<'EOF' || true
import torch, mpi4py, sys
print(f"python {sys.version.split()[0]}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}; mpi4py {mpi4py.__version__}")
EOF
timeout 60 "$PY" mpi/mpi_select.py describe 2>/dev/null | head -3 || true

# -- 3-4. tests ----------------------------------------------------------------------------
step test_cuda_cpu_paths 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py
ASYNCLOCK_REQUIRE_GPU=1 step test_gpu 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/gpu

# -- 4b. the NCCL path: 1 rank over NCCL; 2 ranks on one GPU agree on staging (NCCL refuses) --
eval "$("$PY" mpi/mpi_select.py env "$ASYNCLOCK_TEST_MPI")"
read -r -a L1 <<< "$(launcher 1)"
read -r -a L2 <<< "$(launcher 2)"
step nccl_path_1rank 120 "${L1[@]}" "$PY" tests/gpu/nccl_path.py
step nccl_path_2ranks_1gpu 120 "${L2[@]}" "$PY" tests/gpu/nccl_path.py

# -- 5-6. benchmarks -----------------------------------------------------------------------
step bench_wait 120 "$PY" tests/gpu/bench_wait_gpu.py --reps 15
step bench_train_1rank 150 "${L1[@]}" "$PY" tests/gpu/bench_train_gpu.py --steps 30
step bench_train_2ranks_1gpu 180 "${L2[@]}" "$PY" tests/gpu/bench_train_gpu.py --steps 30
# step time at world size 1, compute / DDP over NCCL / asynclock (target: <= 1.02x DDP)
step bench_step_dropin 150 "${L1[@]}" "$PY" tests/gpu/bench_step_gpu.py --api dropin
step bench_step_async 150 "${L1[@]}" "$PY" tests/gpu/bench_step_gpu.py --api async
[ "$FAILED" = 0 ]
