"""The GPU check (`tests/gpu/run.sh`) runs where a GPU is lent, rarely: its dry run here
keeps the script, its launch lines and the NCCL path's rank program from rotting (CPU
tensors, gloo where NCCL would be: `ASYNCLOCK_CUDA_PATH=gloo-twin`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "tests/gpu/run.sh", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "ASYNCLOCK_GPU_LOGS": str(tmp_path)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "overall: PASS" in out, out[-4000:]
    for step in ("nccl_path_1rank", "nccl_path_2ranks", "bench_step_dropin", "bench_step_async"):
        assert f"PASS  {step}" in out, out[-4000:]
