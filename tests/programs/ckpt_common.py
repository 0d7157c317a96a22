"""State builders and checks shared by the checkpoint programs and tests."""

from __future__ import annotations

from typing import Any

import numpy as np

N = 20_000  # 80-160 KB per file: several write() calls per shard


def make_state(step: int, rank: int, serializer: str) -> dict[str, Any]:
    """Content derived from (step, rank), so any loaded file can be checked alone."""
    w = np.arange(N, dtype=np.int64) * (step + 1) + rank
    if serializer == "torch":
        import torch

        return {"step": step, "rank": rank, "w": torch.from_numpy(w),
                "opt": {"lr": 0.1 * step, "momentum": torch.full((3,), float(step))}}
    return {"step": step, "rank": rank, "w": w}


def check_state(state: dict[str, Any], step: int, rank: int) -> None:
    """The loaded state is exactly what `make_state(step, rank)` wrote."""
    assert state["step"] == step and state["rank"] == rank, (state["step"], state["rank"])
    w = np.asarray(state["w"])
    expected = np.arange(N, dtype=np.int64) * (step + 1) + rank
    assert w.shape == expected.shape and (w == expected).all(), f"w differs at step {step}"
