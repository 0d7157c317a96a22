#!/bin/bash
# Host discovery for an elastic job under Slurm (horovodrun --host-discovery-script runs
# it every second): one `node:slots` line for each node of this allocation that Slurm
# still reports usable. A node that is down, draining, failing or not responding (`*`)
# is left out, so the job re-forms without it; one that comes back is listed again
# and joins at the next commit (under another name, or after horovodrun's
# --blacklist-cooldown-range, if a rank on it failed).
set -uo pipefail
slots=${SLURM_NTASKS_PER_NODE:-1}
slots=${slots%%(*}  # "4(x2)" -> 4
sinfo --noheader --Node --nodes="${SLURM_JOB_NODELIST:?run inside a Slurm job}" \
      --format="%N %t" | while read -r node state; do
    case "$state" in
        *\**|down*|drain*|drng*|fail*|maint*|boot*|unk*|futr*|inval*) ;;
        *) echo "$node:$slots" ;;
    esac
done | sort -u
