#!/usr/bin/env bash
# Install Debian's Slurm (slurm-wlm: slurmctld, slurmd, srun, sbatch) and munge, idempotently.
#
# Why: tests/test_slurm.py starts a private one-node cluster (tests/slurm_cluster.py)
# to run launch/slurm.sbatch, srun and asynclock-launch under a real Slurm. The
# packages' services are not started here: the tests start their own daemons, on
# their own ports, key and socket. Debian's srun brings the MPI plugins both of the
# project's MPIs need: pmix (Open MPI) and pmi2 (the venv's MPICH).
#
# Usage: bash launch/install_slurm.sh     (as root; sudo is used if not)
#        launch/setup.sh runs it with ASYNCLOCK_SETUP_SYSTEM_MPI=1 (launch/test.sh as root)
# Env:   ASYNCLOCK_APT_MAX_AGE_H  re-run `apt-get update` when the package lists
#                                 are older than this many hours (default 24).
set -euo pipefail

PKGS=(slurm-wlm munge)
MAX_AGE_H="${ASYNCLOCK_APT_MAX_AGE_H:-24}"
export DEBIAN_FRONTEND=noninteractive

installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"
}

todo=()
for p in "${PKGS[@]}"; do installed "$p" || todo+=("$p"); done
if (( ${#todo[@]} == 0 )); then
    echo "install_slurm: already installed: ${PKGS[*]}"
    exit 0
fi

SUDO=""
if [[ "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo -E"; else
        echo "install_slurm: need root (or sudo) for apt-get" >&2; exit 1
    fi
fi

lists_stale() {
    # True when apt has no candidate for a package or the lists are old.
    local p newest age_h
    for p in "${PKGS[@]}"; do
        apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [0-9]' || return 0
    done
    newest=$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -printf '%T@\n' 2>/dev/null \
             | sort -n | tail -1)
    [[ -z "$newest" ]] && return 0
    age_h=$(( ( $(date +%s) - ${newest%.*} ) / 3600 ))
    (( age_h >= MAX_AGE_H ))
}

start=$(date +%s)
if lists_stale; then $SUDO apt-get update -qq; fi
# Without systemd the packages' postinst scripts start no daemon; the tests start their own.
log=$(mktemp /tmp/asynclock-install-slurm.XXXXXX)
if ! $SUDO apt-get install -y -qq --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${todo[@]}" \
        >"$log" 2>&1; then
    tail -20 "$log" >&2
    echo "install_slurm: apt-get install ${todo[*]} failed (log: $log)" >&2
    exit 1
fi
rm -f "$log"
plugins=$(find /usr/lib -path '*slurm*' -name 'mpi_*.so' -printf '%f ' 2>/dev/null \
          | sed 's/mpi_\([a-z0-9_]*\)\.so/\1/g')
echo "install_slurm: installed ${todo[*]} in $(( $(date +%s) - start )) s; srun MPI plugins: $plugins"
