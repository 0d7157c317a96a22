#!/usr/bin/env bash
# Set up .venv with everything asynclock needs; idempotent, pip-only (no root).
#   bash launch/setup.sh            # core + embedded MPI (pip mpich) + torch 2.13 CPU
#   ASYNCLOCK_SETUP_SYSTEM_MPI=1    # also apt-install Debian Open MPI (root), for horovodrun,
#                                   # and Slurm + munge, for tests/test_slurm.py
#   ASYNCLOCK_SETUP_HOROVOD=1       # also build Horovod 0.28.1 against torch and that MPI
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
log() { printf '[setup] %s\n' "$*"; }

[ -x .venv/bin/python ] || { log "creating .venv"; "$PY" -m venv .venv; }
VPY="$PWD/.venv/bin/python"
pipi() { "$VPY" -m pip install -q --disable-pip-version-check "$@"; }
# uv installs the same packages from the same index with parallel downloads (pip fetches one
# at a time); pip stays the fallback. uv reads none of pip's settings, so pip's own
# find-links folders are passed on (a local torch file lies there on some machines). Like
# pip, it compiles the bytecode at install: where PYTHONDONTWRITEBYTECODE is set, nothing else
# would, and every rank of every test job would compile torch's modules again.
UV=""
if [ "${ASYNCLOCK_SETUP_UV:-1}" = 1 ]; then
  { [ -x .venv/bin/uv ] || pipi uv >/dev/null 2>&1; } && UV="$PWD/.venv/bin/uv"
fi
links=$("$VPY" -m pip config get global.find-links 2>/dev/null || true)
links="${PIP_FIND_LINKS:-} $links"
uvi() {
  [ -n "$UV" ] || return 1
  local args=() d
  for d in $links; do [ -d "$d" ] && args+=(--find-links "$d"); done
  "$UV" pip install -q --compile-bytecode --python "$VPY" "${args[@]}" "$@"
}
fast_install() { uvi "$@" || pipi "$@"; }

# torch: the pinned CPU build; a looser pin would pull a multi-GB CUDA build. uv takes only a
# CPU build's file found on this disk: from an index it would pick the CUDA build.
if ! "$VPY" -c "import torch" 2>/dev/null; then
  log "installing torch==2.13.0 (CPU)"
  cpu_torch=$(for d in $links; do ls "$d"/torch-2.13.0+cpu-*.whl 2>/dev/null || true; done | head -1)
  { [ -n "$cpu_torch" ] && uvi "$cpu_torch"; } || pipi "torch==2.13.0" \
    || pipi "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi

want=(numpy anyio trio sniffio mpi4py mpich pytest pytest-timeout pytest-xdist tqdm matplotlib scikit-learn mock
      ruff mypy import-linter mkdocs-material "mkdocstrings[python]")
missing=()
for pkg in "${want[@]}"; do
  mod=${pkg//-/_}; [ "$pkg" = scikit-learn ] && mod=sklearn; [ "$pkg" = pytest-timeout ] && mod=pytest_timeout
  [ "$pkg" = pytest-xdist ] && mod=xdist
  [ "$pkg" = import-linter ] && mod=importlinter; [ "$pkg" = mkdocs-material ] && mod=material
  [ "$pkg" = "mkdocstrings[python]" ] && mod=mkdocstrings_handlers.python
  [ "$pkg" = mpich ] && { ls .venv/lib/libmpi.so* >/dev/null 2>&1 || missing+=("$pkg"); continue; }
  "$VPY" -c "import $mod" 2>/dev/null || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then log "installing ${missing[*]}"; fast_install "${missing[@]}"; fi

if [ "${ASYNCLOCK_SETUP_SYSTEM_MPI:-0}" = 1 ]; then
  bash mpi/install_system_mpi.sh
  # Only the Slurm tests need it: they skip, saying why, when it is missing.
  bash launch/install_slurm.sh || log "Slurm not installed: tests/test_slurm.py will skip"
fi
# Installed (editable) from *this* checkout? Checked from / so the cwd does not count.
here=$(pwd -P)
(cd / && "$VPY" -c "import asynclock, os, sys; sys.exit(not os.path.realpath(asynclock.__file__).startswith('$here/'))") 2>/dev/null \
  || { log "installing asynclock (editable)"; pipi --no-deps --no-build-isolation -e .; }
# The C small-message round, per MPI (seconds; without a compiler the Python path runs).
"$VPY" mpi/build_fastpath.py || log "C small-message path not built: the Python path runs"
if [ "${ASYNCLOCK_SETUP_HOROVOD:-0}" = 1 ]; then "$VPY" mpi/build_horovod.py; fi
log "ready: $("$VPY" mpi/mpi_select.py describe 2>/dev/null | head -1 || echo 'MPI kit not found')"
