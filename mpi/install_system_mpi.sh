#!/usr/bin/env bash
# Install Debian's Open MPI (openmpi-bin + libopenmpi-dev) idempotently.
#
# Why: horovodrun's MPI controller only recognises Open MPI (and Intel MPI /
# MPICH via `mpirun --version` strings it knows), and Horovod must be compiled
# against the same libmpi that mpi4py loads at run time.  The pip `mpich` wheel
# in the venv is the fallback ("embedded"); this script provides "system".
#
# Usage: bash mpi/install_system_mpi.sh        (as root; sudo is used if not)
# Env:   ASYNCLOCK_APT_MAX_AGE_H  re-run `apt-get update` when the package lists
#                                 are older than this many hours (default 24).
set -euo pipefail

PKGS=(openmpi-bin libopenmpi-dev)
MAX_AGE_H="${ASYNCLOCK_APT_MAX_AGE_H:-24}"
export DEBIAN_FRONTEND=noninteractive

SUDO=""
if [[ "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo -E"; else
        echo "install_system_mpi: need root (or sudo) for apt-get" >&2; exit 1
    fi
fi

start=$(date +%s.%N)

missing_pkgs() {
    # Print the packages of PKGS that dpkg does not report as installed.
    local p
    for p in "${PKGS[@]}"; do
        if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
            echo "$p"
        fi
    done
}

lists_stale() {
    # True when apt has no candidate for a package or the lists are old.
    local p newest age_h
    for p in "${PKGS[@]}"; do
        if ! apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [0-9]'; then return 0; fi
    done
    newest=$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -printf '%T@\n' 2>/dev/null | sort -n | tail -1)
    [[ -z "$newest" ]] && return 0
    age_h=$(( ( $(date +%s) - ${newest%.*} ) / 3600 ))
    (( age_h >= MAX_AGE_H ))
}

mapfile -t todo < <(missing_pkgs)
if (( ${#todo[@]} == 0 )); then
    echo "install_system_mpi: already installed: ${PKGS[*]} (nothing to do)"
else
    if lists_stale; then
        echo "install_system_mpi: apt-get update (package lists missing or stale)"
        $SUDO apt-get update -q
    else
        echo "install_system_mpi: apt lists fresh, skipping apt-get update"
    fi
    echo "install_system_mpi: apt-get install -y --no-install-recommends ${todo[*]}"
    $SUDO apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${todo[@]}"
fi

end=$(date +%s.%N)
echo "install_system_mpi: mpirun=$(command -v mpirun || echo none) mpicc=$(command -v mpicc || echo none)"
if command -v mpirun >/dev/null 2>&1; then
    mpirun --version 2>/dev/null | head -1 || true
fi
ls -1 /usr/lib/x86_64-linux-gnu/libmpi.so.40* 2>/dev/null || true
awk -v a="$start" -v b="$end" 'BEGIN { printf "install_system_mpi: elapsed %.1f s\n", b - a }' 
