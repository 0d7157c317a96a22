#!/usr/bin/env bash
# README command 1: set up (first run only) and run the demo on 2 ranks.
# Each rank prints its result; rank 0 prints a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
bash launch/run.sh 2 examples/quickstart.py
if [ -f examples/train_digits.py ]; then bash launch/run.sh 2 examples/train_digits.py; fi
