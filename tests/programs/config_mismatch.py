"""Ranks start with different bulk thresholds: every rank must refuse to start."""

from __future__ import annotations

import os

from _common import report

rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
if rank == 1:
    os.environ["ASYNCLOCK_THREAD_MIN_BYTES"] = "4096"

import asynclock  # noqa: E402

try:
    asynclock.init()
except asynclock.MismatchError as exc:
    assert "settings differ" in str(exc) and "rank 1" in str(exc), exc
    report(rank, "refused")
