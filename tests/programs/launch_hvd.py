"""Rank program for the horovodrun runner: Horovod allreduce; `--fail`: rank 1 exits 3."""

from __future__ import annotations

import os
import sys

import horovod.torch as hvd
import torch


def main() -> int:
    hvd.init()
    got = hvd.allreduce(torch.ones(2) * (hvd.rank() + 1), op=hvd.Sum, name="launch")
    want = float(hvd.size() * (hvd.size() + 1) // 2)
    assert torch.equal(got, torch.full((2,), want)), got
    print(f"hvd hello from {hvd.rank()} of {hvd.size()}", flush=True)
    if "--fail" in sys.argv and hvd.rank() == 1:
        os._exit(3)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
